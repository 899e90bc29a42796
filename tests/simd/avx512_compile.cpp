// Compile-only check (no test runs it): the library's kernels and pipelines build for AVX-512, which
// this project's CI machines cannot execute. tests/CMakeLists.txt compiles this file with
// -march=skylake-avx512 -Werror, so a kernel that only works for 8-lane batches fails the build.
// The *_avx512 tests (same CMakeLists) run the kernels' tests for AVX-512 where the CPU has it.
#include <kvcompress/kvcompress.hpp>

#if defined(__AVX512F__)
static_assert(kvc::simd::fbatch<kvc::simd::default_arch>::size == 16, "AVX-512 should give 16 float lanes");
#endif

namespace kvc_avx512_check {

template <class Preset, class T>
kvc::LayerResult<kvc::compute_t<T>> compress(const kvc::LayerView<T>& layer) {
  return Preset{}.run(layer, kvc::Budget::ratio(0.25));
}

template <class T>
void instantiate(const kvc::LayerView<T>& layer, const kvc::RowMatrix<float>& q, kvc::RowMatrix<float>& out) {
  compress<kvc::SnapKV>(layer);
  compress<kvc::SelKV>(layer);
  compress<kvc::SnapKVGRKV>(layer);
  kvc::decode_attention<T>(q, layer.keys, layer.values, kvc::BiasView<float>{}, kvc::AttentionArguments{}, out);
}

template void instantiate<float>(const kvc::LayerView<float>&, const kvc::RowMatrix<float>&, kvc::RowMatrix<float>&);
template void instantiate<Eigen::half>(const kvc::LayerView<Eigen::half>&, const kvc::RowMatrix<float>&,
                                       kvc::RowMatrix<float>&);
template void instantiate<Eigen::bfloat16>(const kvc::LayerView<Eigen::bfloat16>&, const kvc::RowMatrix<float>&,
                                           kvc::RowMatrix<float>&);

}  // namespace kvc_avx512_check
