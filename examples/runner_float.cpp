// Every preset instantiated for float caches (see runner.hpp).
#include "runner.hpp"

namespace kvc::cli {
template std::unique_ptr<Runner<float>> make_runner<float>(const std::string&, const MethodOptions&, Index);
}  // namespace kvc::cli
