// Which kernel family may run: the CPU's features, narrowed by KVSERVE_CPU_ISA.

#include <cstdlib>
#include <cstring>

#include "amx_tiles.h"
#include "common.h"
#include "ops.h"

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

bool amx_available() {
#ifdef KVSERVE_HAVE_AMX
  // Asked once: the grant (a system call) covers every thread of the process.
  static const bool available = amx_kernels_allowed() && bf16_linear_supported() &&
                                amx::cpu_has_amx_bf16() && amx::kernel_grants_tile_data();
  return available;
#else
  return false;
#endif
}

}  // namespace kvserve
