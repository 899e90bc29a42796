// Per-stage benchmarks on the Llama-3.1-8B layer shape, each with x_gemm (its CPU time over the plain
// Eigen Qw·K^T of the same layer, measured in this process) and tokens/s; plus the probes.
#include "bench_common.hpp"
#include <map>
#include <random>
#include <vector>

namespace {

using namespace kvc;
using namespace kvc::bench;

/// The plain product itself: x_gemm = 1 by construction; reports GFLOP/s and its fraction of peak.
void BM_Gemm(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  for (auto _ : state) state.SetIterationTime(gemm_seconds(n));
  set_layer_counters(state, n, gemm_seconds(n));
  state.counters["GFLOP/s"] = layer_gemm_flops(layer) / gemm_seconds(n) * 1e-9;
  state.counters["frac_peak"] = layer_gemm_flops(layer) / gemm_seconds(n) * 1e-9 / peak_gflops();
}

/// Peak FMA probe (GFLOP/s of one core for the compiled architecture).
void BM_PeakFma(benchmark::State& state) {
  for (auto _ : state) state.SetIterationTime(1e-3);
  state.counters["GFLOP/s"] = peak_gflops();
  state.counters["lanes"] = double(simd::fbatch<simd::default_arch>::size);
}

/// Stage 1 of the pipeline for all KV heads: window attention mass a_g (fused product + causal softmax +
/// column sums). frac_peak = the product's FLOPs / time / peak FMA: how close product+softmax gets to the
/// machine's FMA peak.
void window_mass_benchmark(benchmark::State& state, WindowProduct P) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  if (!skip_unless_available(state, P)) return;
  AttentionArguments args;
  args.product = P;
  WindowWorkspace<float> ws;
  Vector<float> mass;
  const auto all_heads = [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      window_mass<float>(layer, g, args, mass, ws);
      benchmark::DoNotOptimize(mass.data());
    }
  };
  const double per = time_iterations(state, all_heads);
  set_layer_counters(state, n, per);
  state.counters["frac_peak"] = layer_gemm_flops(layer) / per * 1e-9 / peak_gflops();
  state.counters["workspace_MB"] = double(ws.bytes()) / 1e6;
  // The timed iterations find the workspace where the previous one left it: in the last-level cache
  // when it fits there. Inside the pipeline the other stages' passes over K, V and the result have
  // evicted it by the next call. cold_ms: median of 3 runs over all heads, each after the workspace's
  // exponentials buffer (its only large part) is flushed from every cache level (x86-64).
  std::vector<double> cold;
  for (int rep = 0; rep < 3; ++rep) {
    if (!evict_from_caches(ws.exps.data(), static_cast<std::size_t>(ws.exps.size()) * sizeof(float))) break;
    const double t0 = thread_seconds();
    all_heads();
    cold.push_back(thread_seconds() - t0);
  }
  if (cold.size() == 3) {
    const double median_cold = median_of(cold);
    state.counters["cold_ms"] = median_cold * 1e3;
    state.counters["x_gemm_cold"] = median_cold / gemm_seconds(n);
  }
}

void BM_WindowMass(benchmark::State& state) { window_mass_benchmark(state, WindowProduct::fma); }

/// The same with the opt-in AMX bf16x3 product (AttentionArguments::product); frac_peak is still the
/// product's float FLOPs over the float FMA peak, so it can exceed 1.
void BM_WindowMassAmx(benchmark::State& state) { window_mass_benchmark(state, WindowProduct::amx_bf16x3); }

/// Stage 1 without its mass pass: the window-attention product and the causal online softmax, as
/// window_mass runs them (detail::window_exp_tiles_t: the exponentials of every key tile written to the
/// workspace), all heads. frac_peak: the product and softmax's fraction of the FMA peak;
/// BM_WindowMass adds the column sums (the mass pass) on top.
void BM_WindowSoftmax(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  WindowWorkspace<float> ws;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      const bool finite = kvc::detail::window_exp_tiles_t<simd::default_arch>(layer, g, AttentionArguments{}, ws);
      benchmark::DoNotOptimize(finite);
      benchmark::DoNotOptimize(ws.exps.data());
    }
  });
  set_layer_counters(state, n, per);
  state.counters["frac_peak"] = layer_gemm_flops(layer) / per * 1e-9 / peak_gflops();
}

/// The product alone, as stage 1 runs it (simd::window_logits_t over the same tiles of kSoftmaxTile keys,
/// queries packed once per head) but into one reused tile, with no softmax and no mass pass: frac_peak is
/// the micro-kernel's own fraction of the FMA peak, and BM_WindowMass minus this is the epilogue's cost.
void BM_WindowLogits(benchmark::State& state) {
  using A = simd::default_arch;
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Index d = layer.head_dim(), R = layer.group_size() * layer.window(), Rp = simd::padded_queries<A>(R);
  constexpr Index tile = kvc::detail::kSoftmaxTile;
  std::vector<float> packed(static_cast<std::size_t>(Rp * d)), x(static_cast<std::size_t>(tile * Rp));
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      const auto q = kvc::gather_group_queries<float>(layer, g);
      simd::pack_queries<A>(q.data(), d, R, d, 1.0f, packed.data());
      for (Index j0 = 0; j0 < n; j0 += tile) {
        const Index cnt = std::min(tile, n - j0), next = std::min(tile, n - j0 - cnt);
        simd::window_logits_t<A>(layer.keys.row(g, j0), layer.keys.token_stride, cnt, d, packed.data(), Rp,
                                 x.data(), Rp, next > 0 ? layer.keys.row(g, j0 + cnt) : nullptr, next);
      }
      benchmark::DoNotOptimize(x.data());
    }
  });
  set_layer_counters(state, n, per);
  state.counters["frac_peak"] = layer_gemm_flops(layer) / per * 1e-9 / peak_gflops();
}

/// Can a pass over memory hide under the product on this machine? (The premise of a pipeline that
/// costs little more than its product: SnapKV's NaN/Inf scan of V, SelKV's value norms, the kept-row
/// gathers are all streams of that kind.) Three passes per head, each over n keys in tiles of
/// kSoftmaxTile, timed separately in every iteration:
///   product:        window_logits_t on one L2-resident tile of keys, n / tile times (no DRAM traffic);
///   product+stream: the same, its `next` argument pointing at the head's V rows of the following tile,
///                   so the kernel's panel passes pull nearly all of V into L2 alongside the product
///                   (not the first tile, nor the rows of a tile's last partial block of keys), spread
///                   over the passes as stage 1 does for the next keys;
///   stream:         a SIMD sum over the V rows of head g + Hkv/2 (the bytes alone; another head's, so
///                   that it does not find in cache what product+stream has just read: each head's V
///                   is read by both passes once per iteration, half an iteration apart).
/// hidden = (product + stream − product+stream) / stream: 1 = the traffic costs nothing beside the
/// product, 0 = the two add up. Iteration time: product+stream. frac_peak_l2: the product's fraction of
/// the FMA peak on L2-resident keys.
void BM_ProductStreamOverlap(benchmark::State& state) {
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Index d = layer.head_dim(), R = layer.group_size() * layer.window(), Rp = simd::padded_queries<A>(R);
  constexpr Index tile = kvc::detail::kSoftmaxTile;
  if (layer.values.token_stride != layer.keys.token_stride) {  // `next` shares the keys' row stride
    state.SkipWithError("K and V token strides differ");
    return;
  }
  std::vector<float> packed(static_cast<std::size_t>(Rp * d)), x(static_cast<std::size_t>(tile * Rp));
  double t_product = 0, t_both = 0, t_stream = 0;
  auto products = [&](Index g, bool stream) {
    const auto q = kvc::gather_group_queries<float>(layer, g);
    simd::pack_queries<A>(q.data(), d, R, d, 1.0f, packed.data());
    const float* keys = layer.keys.row(g, 0);  // rows 0..tile: the same tile every time, in L2
    for (Index j0 = 0; j0 < n; j0 += tile) {
      const Index cnt = std::min(tile, n - j0), next = std::min(tile, n - j0 - cnt);
      simd::window_logits_t<A>(keys, layer.keys.token_stride, cnt, d, packed.data(), Rp, x.data(), Rp,
                               stream && next > 0 ? layer.values.row(g, j0 + cnt) : nullptr, stream ? next : 0);
    }
    benchmark::DoNotOptimize(x.data());
  };
  for (auto _ : state) {
    double both = 0;
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      double t0 = thread_seconds();
      products(g, false);
      double t1 = thread_seconds();
      products(g, true);
      double t2 = thread_seconds();
      const Index other = (g + layer.kv_heads() / 2) % layer.kv_heads();
      B acc(0.0f);
      float tail = 0.0f;
      for (Index j = 0; j < n; ++j) {
        const float* v = layer.values.row(other, j);
        Index k = 0;
        for (; k + Index(B::size) <= d; k += Index(B::size)) acc += B::load_unaligned(v + k);
        for (; k < d; ++k) tail += v[k];
      }
      benchmark::DoNotOptimize(simd::reduce_add<A>(acc) + tail);
      const double t3 = thread_seconds();
      t_product += t1 - t0;
      t_both += t2 - t1;
      t_stream += t3 - t2;
      both += t2 - t1;
    }
    state.SetIterationTime(both);
  }
  const double it = double(state.iterations());
  set_layer_counters(state, n, t_both / it);
  state.counters["product_ms"] = t_product / it * 1e3;
  state.counters["product_stream_ms"] = t_both / it * 1e3;
  state.counters["stream_ms"] = t_stream / it * 1e3;
  state.counters["hidden"] = (t_product + t_stream - t_both) / t_stream;
  state.counters["frac_peak_l2"] = layer_gemm_flops(layer) / (t_product / it) * 1e-9 / peak_gflops();
}

/// Full probabilities (what GRKV and the co-attention router read), all heads.
void BM_WindowProbabilities(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  RowMatrix<float> probs;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      window_probabilities<float>(layer, g, AttentionArguments{}, probs);
      benchmark::DoNotOptimize(probs.data());
    }
  });
  set_layer_counters(state, n, per);
}

/// Scorers over all KV heads (ValueWeighted reads V once; KeyNorm reads K once; LastQueryAttention
/// computes the last window row's logits over every key).
template <class Scorer>
void BM_Score(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Vector<float> mass = Vector<float>::Constant(n, 1.0f / float(n));
  Vector<float> out;
  const AttentionArguments attention;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      Scorer{}.score(ScoreContext<float>(layer, g, attention, mass), out);
      benchmark::DoNotOptimize(out.data());
    }
  });
  set_layer_counters(state, n, per);
  state.counters["bytes/s"] = double(layer.kv_heads() * n * layer.head_dim() * 4) / per;
}

/// ObservedAttention (H2O) reads every prefill query: the benchmark layer's K and V with Hq·n random
/// queries (built once per n), at sizes where its O(n²·d) cost stays short. x_gemm is against the
/// window product (W = 32) at the same n.
void BM_ScoreObserved(benchmark::State& state) {
  const Index n = state.range(0);
  const BenchLayer& base = layer_of(n);
  static std::map<Index, std::vector<float>> all_queries;
  std::vector<float>& q = all_queries[n];
  if (q.empty()) {
    std::mt19937_64 rng(11);
    std::normal_distribution<float> normal;
    q.resize(static_cast<std::size_t>(base.query_heads * n * base.dim));
    for (float& x : q) x = normal(rng);
  }
  LayerView<float> layer = base.view();
  layer.queries = make_head_major<const float>(q.data(), base.query_heads, n, base.dim);
  const Vector<float> mass = Vector<float>::Zero(n);
  Vector<float> out;
  const AttentionArguments attention;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      ObservedAttention{}.score(ScoreContext<float>(layer, g, attention, mass), out);
      benchmark::DoNotOptimize(out.data());
    }
  });
  set_layer_counters(state, n, per);
}

/// CriticalKV's scorer over all KV heads with a random W_o [D = Hq·d][Hq·d] (Llama-3.1-8B: 4096 ×
/// 4096, built once) and budget n/4: its n·Hq·d·D product for ‖W_o v‖₁ is D/W times the window
/// product's n·Hq·W·d, which x_gemm compares it with.
void BM_ScoreCritical(benchmark::State& state) {
  const Index n = state.range(0);
  LayerView<float> layer = layer_of(n).view();
  const Index cols = layer.query_heads() * layer.head_dim();
  static std::vector<float> wo;
  if (wo.empty()) {
    std::mt19937_64 rng(12);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    wo.resize(static_cast<std::size_t>(cols * cols));
    for (float& x : wo) x = normal(rng);
  }
  layer.output_projection = {wo.data(), cols, cols, cols};
  const Vector<float> mass = Vector<float>::Constant(n, 1.0f / float(n));
  Vector<float> out;
  const AttentionArguments attention;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < layer.kv_heads(); ++g) {
      ScoreContext<float> ctx(layer, g, attention, mass);
      ctx.set_budget(n / 4);
      CriticalAttention{}.score(ctx, out);
      benchmark::DoNotOptimize(out.data());
    }
  });
  set_layer_counters(state, n, per);
}

/// SelKV's window mass and scores (ValueWeighted) of every KV head of the benchmark layer at n,
/// computed once per n (default attention arguments).
struct LayerScores {
  std::vector<Vector<float>> mass, score;
};
const LayerScores& selkv_scores(Index n) {
  static std::map<Index, LayerScores> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  const auto layer = layer_of(n).view();
  const Index H = layer.kv_heads();
  LayerScores s;
  s.mass.resize(static_cast<std::size_t>(H));
  s.score.resize(static_cast<std::size_t>(H));
  WindowWorkspace<float> ws;
  for (Index g = 0; g < H; ++g) {
    window_mass<float>(layer, g, AttentionArguments{}, s.mass[g], ws);
    ValueWeighted{}.score(ScoreContext<float>(layer, g, AttentionArguments{}, s.mass[g]), s.score[g]);
  }
  return cache.emplace(n, std::move(s)).first->second;
}

/// Times sel.select(scores, budgets) into a fresh Selection per iteration. Its own loop (not
/// time_iterations): each iteration's fresh result is freed outside the timed part.
template <class Selector>
void time_select(benchmark::State& state, const Selector& sel, const std::vector<Vector<float>>& scores,
                 const std::vector<Index>& budgets, Index n) {
  double total = 0;
  for (auto _ : state) {
    const double t0 = thread_seconds();
    Selection<float> out;
    sel.select(scores, budgets, out);
    const double t = thread_seconds() - t0;
    benchmark::DoNotOptimize(out.kept.data());
    total += t;
    state.SetIterationTime(t);
  }
  set_layer_counters(state, n, total / double(state.iterations()));
}

/// Selector (pooling + top-k) for all KV heads at ratio 0.25, per head (SnapKV) and shared (SelKV), on
/// uniform random scores (Layer = false) or on SelKV's scores of the benchmark layer (Layer = true),
/// which crowd into a narrow range (most share their top 11 bits: TopK's refine_edge path).
template <Granularity Gr, bool Layer = false>
void BM_Select(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  std::vector<Vector<float>> scores(layer.kv_heads());
  if (Layer) scores = selkv_scores(n).score;
  else for (auto& s : scores) s = Vector<float>::Random(n).cwiseAbs();
  const std::vector<Index> budgets(layer.kv_heads(), n / 4);
  TopK<0, 32, 5, Gr> sel;
  time_select(state, sel, scores, budgets, n);
}

/// ChunkKV's selection (TopChunks: recent 32, pool 5, 20-token chunks, shared) on SelKV's scores of
/// the benchmark layer, budget n/4.
void BM_SelectChunks(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const std::vector<Vector<float>>& scores = selkv_scores(n).score;
  const std::vector<Index> budgets(layer.kv_heads(), n / 4);
  TopChunks<20, 0, 32, 5> sel;
  time_select(state, sel, scores, budgets, n);
}

/// Threshold's selection (ThresholdSelect: recent 64) on SelKV's scores of the benchmark layer, τ at
/// their median so that about half qualify, capped at n/4 (the cap's sort included).
void BM_SelectThreshold(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const std::vector<Vector<float>>& scores = selkv_scores(n).score;
  const std::vector<Index> budgets(layer.kv_heads(), n / 4);
  std::vector<float> sorted(scores[0].data(), scores[0].data() + n);
  std::nth_element(sorted.begin(), sorted.begin() + n / 2, sorted.end());
  ThresholdSelect<64> sel{{double(sorted[static_cast<std::size_t>(n / 2)]), 64}};
  time_select(state, sel, scores, budgets, n);
}

/// SelKV's per-head stages after selection (key-cosine bucket routing, soft-gate merge, log R bias),
/// all KV heads, with the selection and mass computed once outside the timing and one set of output
/// buffers per head, allocated and written before the timing and reused by every iteration, after
/// time_iterations' untimed first pass (one set per head, as the pipeline's result: a single shared
/// set could stay in the last-level cache and flatter the stage). As in the pipeline, nothing is gathered: the router
/// writes the kept keys (fills_keys), SoftGate the values (fills_values).
void BM_RouteMergeCompensate(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Index H = layer.kv_heads(), d = layer.head_dim();
  const auto& mass = selkv_scores(n).mass;
  Selection<float> sel;
  TopK<0, 16, 5, Granularity::shared>{}.select(selkv_scores(n).score, std::vector<Index>(H, n / 4), sel);
  const AttentionArguments att;
  // As in the pipeline: the kept keys with streaming stores when the whole result is large.
  const bool streaming = detail::result_rows_bytes(sel.kept, d, sizeof(float)) >= detail::kStreamMinBytes;
  // One set of buffers per head, as the pipeline's result, reused by every iteration.
  std::vector<MergeOutput<float>> merged(static_cast<std::size_t>(H));
  for (Index g = 0; g < H; ++g) {
    merged[g].keys.setZero(Index(sel.kept[g].size()), d);  // touched once here, not in the timing
    merged[g].values.setZero(Index(sel.kept[g].size()), d);
  }
  Vector<float> bias;
  Routing routing;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < H; ++g) {
      HeadContext<float> ctx(layer, g, att, mass[g], sel.score[g], sel.kept[g], sel.evicted[g]);
      ctx.set_streaming_stores(streaming);
      static_assert(policy_traits<BucketRouter<32>>::fills_keys && policy_traits<SoftGate>::fills_values,
                    "as in the pipeline: the router writes the kept keys and SoftGate every value row");
      BucketRouter<32>{}.route(ctx, routing, merged[g].keys);
      SoftGate{}.merge(ctx, routing, merged[g]);
      AttentionRatio{}.compensate(ctx, routing, merged[g], bias);
      benchmark::DoNotOptimize(bias.data());
    }
  });
  set_layer_counters(state, n, per);
}

/// The memory floor of BM_RouteMergeCompensate, no arithmetic: the same selection, every row of K then
/// V read once in position order (a SIMD sum over the evicted rows), each kept row copied into the same
/// output buffers, with streaming stores where the stage would use them.
void BM_RouteMergeFloor(benchmark::State& state) {
  using A = simd::default_arch;
  using B = simd::fbatch<A>;
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Index H = layer.kv_heads(), d = layer.head_dim();
  Selection<float> sel;
  TopK<0, 16, 5, Granularity::shared>{}.select(selkv_scores(n).score, std::vector<Index>(H, n / 4), sel);
  const bool streaming = detail::result_rows_bytes(sel.kept, d, sizeof(float)) >= detail::kStreamMinBytes;
  std::vector<MergeOutput<float>> out(static_cast<std::size_t>(H));
  for (Index g = 0; g < H; ++g) {
    out[g].keys.setZero(Index(sel.kept[g].size()), d);
    out[g].values.setZero(Index(sel.kept[g].size()), d);
  }
  const double per = time_iterations(state, [&] {
    B acc(0.0f);
    for (Index g = 0; g < H; ++g)
      for (const bool keys : {true, false}) {
        const auto& view = keys ? layer.keys : layer.values;
        RowMatrix<float>& rows = keys ? out[g].keys : out[g].values;
        const auto& kept = sel.kept[g];
        std::size_t i = 0;
        for (Index j = 0; j < n; ++j) {
          const float* r = view.row(g, j);
          if (i < kept.size() && kept[i] == j) {
            float* dst = rows.row(Index(i++)).data();
            if (!(streaming && detail::copy_row_streaming(r, dst, d))) std::copy(r, r + d, dst);
          } else {
            for (Index k = 0; k + Index(B::size) <= d; k += Index(B::size)) acc += B::load_unaligned(r + k);
          }
        }
      }
    detail::streaming_done();
    benchmark::DoNotOptimize(simd::reduce_add<A>(acc));
  });
  set_layer_counters(state, n, per);
}

/// A merger after per-head selection (recent 32, pool 5, budget n/4, on SelKV's scores of the layer),
/// all KV heads: Router then Merger per head, with the selection and mass computed once outside the
/// timing. The kept rows are gathered once into one set of buffers per head before the timing; later
/// iterations merge into the previous iteration's values, the same work. SnapKVNearestKey's stages
/// (global key-cosine routing, O((n − m)·m·d)) and SnapKVCAM's (no routing).
template <class Router, class Merger>
void BM_Merge(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const Index H = layer.kv_heads(), d = layer.head_dim();
  const auto& mass = selkv_scores(n).mass;
  Selection<float> sel;
  TopK<0, 32, 5>{}.select(selkv_scores(n).score, std::vector<Index>(H, n / 4), sel);
  const AttentionArguments att;
  std::vector<MergeOutput<float>> merged(static_cast<std::size_t>(H));
  for (Index g = 0; g < H; ++g) {
    const Index m = Index(sel.kept[g].size());
    merged[g].keys.resize(m, d);
    merged[g].values.resize(m, d);
    for (Index i = 0; i < m; ++i)
      for (Index c = 0; c < d; ++c) {
        merged[g].keys(i, c) = layer.keys.row(g, sel.kept[g][i])[c];
        merged[g].values(i, c) = layer.values.row(g, sel.kept[g][i])[c];
      }
  }
  Routing routing;
  const double per = time_iterations(state, [&] {
    for (Index g = 0; g < H; ++g) {
      HeadContext<float> ctx(layer, g, att, mass[g], sel.score[g], sel.kept[g], sel.evicted[g]);
      Router{}.route(ctx, routing);
      Merger{}.merge(ctx, routing, merged[g]);
      benchmark::DoNotOptimize(merged[g].values.data());
    }
  });
  set_layer_counters(state, n, per);
}

/// Pipeline::validate's input scan (shapes + NaN/Inf in K, V and the window queries; core.hpp), the
/// fixed cost every preset pays with the default check_finite = true.
void BM_ValidateLayer(benchmark::State& state) {
  const Index n = state.range(0);
  const auto layer = layer_of(n).view();
  const double per = time_iterations(state, [&] {
    benchmark::DoNotOptimize(validate_layer(layer, true).is_ok());
  });
  set_layer_counters(state, n, per);
}

/// Streaming-sum bandwidth probe over the bytes of a whole layer's K and V at this n (the decode
/// benchmark's reference).
void BM_StreamSum(benchmark::State& state) {
  const Index n = state.range(0);
  const std::size_t bytes = std::size_t(2 * 8 * n * 128) * sizeof(float);
  const double bps = stream_bytes_per_second(bytes);
  for (auto _ : state) state.SetIterationTime(double(bytes) / bps);
  state.counters["bytes/s"] = bps;
}

}  // namespace

BENCHMARK(BM_PeakFma)->UseManualTime();
BENCHMARK(BM_Gemm)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_WindowMass)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_WindowMassAmx)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_WindowSoftmax)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_WindowLogits)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_ProductStreamOverlap)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_WindowProbabilities)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::ValueWeighted)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::KeyNorm)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::KeyDiversity)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::LastQueryAttention)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::LocalLeverage)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::LagRelative)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Score, kvc::ExpectedAttention)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_ScoreObserved)->Arg(1024)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScoreCritical)->Arg(4096)->Arg(32768)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Select, kvc::Granularity::per_head)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Select, kvc::Granularity::shared)->Apply(kvc::bench::layer_sizes);
BENCHMARK_TEMPLATE(BM_Select, kvc::Granularity::shared, true)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_SelectChunks)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_SelectThreshold)->Apply(kvc::bench::layer_sizes);
// n = 512 too: K and V of the layer (4 MiB) stay in cache, so its tokens/s is the arithmetic alone.
BENCHMARK(BM_RouteMergeCompensate)->Arg(512)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_RouteMergeFloor)->Apply(kvc::bench::layer_sizes);
// Global routing is quadratic in n: the smallest layer only.
BENCHMARK_TEMPLATE(BM_Merge, kvc::BucketRouter<0>, kvc::NearestKeyMerge)->Arg(4096)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_Merge, kvc::NoRoute, kvc::CacheMerge)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_ValidateLayer)->Apply(kvc::bench::layer_sizes);
BENCHMARK(BM_StreamSum)->Apply(kvc::bench::layer_sizes);
