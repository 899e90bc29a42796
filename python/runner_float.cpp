// Every preset instantiated for float caches (see runner.hpp).
#include "runner.hpp"

namespace kvc::python {
template std::unique_ptr<Runner<float>> make_runner<float>(const std::string&, const cli::MethodOptions&, Index);
}  // namespace kvc::python
