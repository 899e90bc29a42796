// Fails the build if the light core header ever pulls in SIMD or the pipeline.
#include <kvcompress/core.hpp>
#if defined(XSIMD_HPP) || defined(XSIMD_CONFIG_HPP)
#error "kvcompress/core.hpp must not include xsimd"
#endif
#ifdef EIGEN_DENSE_MODULE_H
#error "kvcompress/core.hpp must include Eigen/Core only, not Eigen/Dense"
#endif
int kvc_core_is_light_anchor() { return 0; }
