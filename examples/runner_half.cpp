// The runners for float16 caches (see runner.hpp); their presets come from presets_half.cpp.
#include "runner.hpp"

namespace kvc::cli {
template std::unique_ptr<Runner<Eigen::half>> make_runner<Eigen::half>(const std::string&, const MethodOptions&, Index);
}  // namespace kvc::cli
