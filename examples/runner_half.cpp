// Every preset instantiated for float16 caches (see runner.hpp).
#include "runner.hpp"

namespace kvc::cli {
template std::unique_ptr<Runner<Eigen::half>> make_runner<Eigen::half>(const std::string&, const MethodOptions&, Index);
}  // namespace kvc::cli
