// Which kernel family may run: the CPU's features, narrowed by KVSERVE_CPU_ISA.

#include <cstdlib>
#include <cstring>

#include "common.h"

namespace kvserve {

bool avx512_kernels_allowed() {
  // Read once: every later call (one per op) sees the same answer.
  static const bool allowed = [] {
    const char* isa = std::getenv("KVSERVE_CPU_ISA");
    return isa == nullptr || std::strcmp(isa, "avx2") != 0;
  }();
  return allowed;
}

bool amx_kernels_allowed() {
  static const bool allowed = std::getenv("KVSERVE_CPU_ISA") == nullptr;
  return allowed;
}

}  // namespace kvserve
