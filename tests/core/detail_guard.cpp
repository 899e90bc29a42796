// Must fail to compile (tests/CMakeLists.txt): a private header included directly.
#include <kvcompress/detail/rows.hpp>
int main() { return 0; }
