// kvc_demo: the README's demo. Runs the synthetic demo (the real-model demo comes with the harness).
#include "synthetic_demo.hpp"

int main() {
  kvc::demo::run_synthetic_demo();
  return 0;
}
