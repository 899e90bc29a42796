// GRKV on real caches (TinyStories-260K): the ridge merge lowers the window attention-output error of
// SnapKV's eviction on every layer at rho = 0.1 and 0.25, and reports sane CG statistics.
// Exits 77 (reported as skipped) when the model files are absent.
#include <catch2/catch.hpp>

#include "support/model_dir.hpp"
#include "support/test_main.hpp"

#include "engine/eval.hpp"
#include "engine/model_path.hpp"
#include "engine_bridge.hpp"
#include "presets_compiled.hpp"  // the presets compiled once (kvc_cli_methods)

#include <iostream>

namespace {
const std::string& g_model_dir = kvc::test::model_dir();

/// Prefills `prefix` tokens of a sampled sequence and calls fn(layer_index, LayerView) on every layer.
template <class Fn>
void for_each_layer(std::size_t prefix, std::uint64_t seed, Fn&& fn) {
  const auto model = kvc::engine::Model::load(g_model_dir + "/stories260K.bin");
  const auto seqs = kvc::engine::sample_sequences(model, 1, static_cast<int>(prefix), seed);
  kvc::engine::Session session(model);
  session.prefill(seqs[0], 32);
  session.compress([&](const kvc::engine::LayerInput& in) {
    fn(in.layer, kvc::cli::view_of(in));
    return kvc::engine::full_compressor()(in);
  });
}
}  // namespace

/// The papers' fixed λ (lambda_mode fixed), with or without the whole-window safeguard.
kvc::SnapKVGRKV grkv_with(double lambda, bool safeguard) {
  kvc::SnapKVGRKV::Arguments args;
  args.merger.lambda_mode = kvc::RidgeMerge::Arguments::LambdaMode::fixed;
  args.merger.lambda_v = args.merger.lambda_k = lambda;
  args.merger.safeguard = safeguard;
  return kvc::SnapKVGRKV(args);
}

void check_lowers(const kvc::LayerView<float>& view, double rho, const kvc::SnapKVGRKV& grkv_preset,
                  bool per_head) {
  const auto evict = kvc::SnapKV{}.run(view, kvc::Budget::ratio(rho));
  const auto grkv = grkv_preset.run(view, kvc::Budget::ratio(rho));
  // Same eviction: GRKV only re-fits the kept entries.
  for (std::size_t g = 0; g < evict.heads.size(); ++g) CHECK(evict.heads[g].positions == grkv.heads[g].positions);
  const double before = kvc::window_output_error(view, evict);
  const double after = kvc::window_output_error(view, grkv);
  CHECK(after < before);
  for (const auto& h : grkv.heads) {
    const auto& d = h.diagnostics;
    if (per_head) CHECK(d.window_error_after < d.window_error_before);
    CHECK(d.cg_iterations <= 100);
    CHECK(std::isfinite(d.cg_residual));
    CHECK(h.keys.allFinite());
    CHECK(h.values.allFinite());
  }
}

TEST_CASE("SnapKV + GRKV lowers the window error on real caches", "[ridge][model]") {
  for (std::uint64_t seed : {1u, 2u}) {
    if (seed == 2 && kvc::test::kSanitizerBuild) break;
    for_each_layer(384, seed, [&](int layer, const kvc::LayerView<float>& view) {
      INFO("seed " << seed << " layer " << layer);
      // rho = 0.25 with the papers' fixed lambda 0.01 (value then key step): every head improves.
      check_lowers(view, 0.25, grkv_with(0.01, false), true);
      // rho = 0.1: the default key step overshoots on some heads (SPEC §9, §12: GRKV at lambda 0.01 is
      // behind SnapKV there); the safeguard keeps a key step only where it helps, and lambda 0.1 is the
      // setting SPEC §12 reports as better at this ratio.
      check_lowers(view, 0.1, grkv_with(0.01, true), true);
      check_lowers(view, 0.1, grkv_with(0.1, true), true);
      // The default (lambda chosen on held-out window rows, safeguard on) fits 3/4 of the rows and
      // guards the other 1/4: the layer's whole window error falls at every ratio.
      for (double rho : {0.1, 0.25, 0.5}) check_lowers(view, rho, kvc::SnapKVGRKV{}, false);
      if (seed == 1) {
        const auto grkv = grkv_with(0.01, false).run(view, kvc::Budget::ratio(0.25));
        double mean_before = 0, mean_after = 0, iters = 0;
        for (const auto& h : grkv.heads) {
          mean_before += h.diagnostics.window_error_before / grkv.heads.size();
          mean_after += h.diagnostics.window_error_after / grkv.heads.size();
          iters += double(h.diagnostics.cg_iterations) / grkv.heads.size();
        }
        // The default fits the CG on 3/4 of the rows: its CG work (iterations × rows) stays within the
        // issue's 1.3× of the fixed λ's.
        double holdout_iters = 0;
        const auto held = kvc::SnapKVGRKV{}.run(view, kvc::Budget::ratio(0.25));
        for (const auto& h : held.heads) holdout_iters += double(h.diagnostics.cg_iterations) / held.heads.size();
        CHECK(holdout_iters * 0.75 <= 1.3 * iters);
        int overshoot = 0;
        for (const auto& h : grkv_with(0.01, false).run(view, kvc::Budget::ratio(0.1)).heads)
          overshoot += h.diagnostics.window_error_after > h.diagnostics.window_error_before;
        std::cout << "layer " << layer << " rho 0.25: window error " << mean_before << " -> " << mean_after
                  << " (mean over heads), CG iterations " << iters << " (mean per head), default "
                  << holdout_iters << " on 3/4 of the rows; rho 0.1 fixed lambda 0.01: "
                  << overshoot << " of " << grkv.heads.size() << " heads overshoot\n";
      }
    });
  }
}

namespace {
const kvc::test::RunOnlyIf needs_model(kvc::test::model_dir_missing);
}  // namespace
