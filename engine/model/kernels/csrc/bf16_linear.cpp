// Few-row bf16 linear on CPUs with AVX512_BF16: bf16 activations against bf16 weights,
// float32 accumulation (vdpbf16ps: 32 products per instruction), bf16 out. Decode steps
// of one to a few rows, where the cost is streaming the weights from memory once.
//
// Compiled for AVX512_BF16 whatever the build machine (a target attribute), and only
// called where the CPU has it: bf16_linear_supported() reads the CPU's features at run
// time, so one build serves AVX2-only and AVX-512 machines alike.

#include <algorithm>
#include <cstring>

#include "bf16_dot.h"
#include "common.h"
#include "ops.h"

namespace kvserve {

bool bf16_linear_supported() {
#ifdef KVSERVE_HAVE_BF16_KERNEL
  static const bool supported = __builtin_cpu_supports("avx512bf16") && avx512_kernels_allowed();
  return supported;
#else
  return false;
#endif
}

#ifdef KVSERVE_HAVE_BF16_KERNEL
namespace {

// float32 -> bf16, round to nearest even (what torch's .to(torch.bfloat16) does).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

KVSERVE_BF16_TARGET void bf16_linear_rows(uint16_t* op, const uint16_t* xp, const uint16_t* wp,
                                          int64_t rows, int64_t in, int64_t outs) {
  for_each_weight_row(
      rows, outs, in, wp, prefetch_plan().bf16,
      [&](auto M, int64_t m, const uint16_t* w, float* dots) {
        dot_rows_bf16<decltype(M)::value>(xp + m * in, in, w, in, dots);
      },
      [&](int64_t m, int64_t n, float dot) { op[m * outs + n] = to_bf16(dot); });
}

}  // namespace
#endif

// out[m, n] = x[m] . weight[n] for bf16 x [rows, in] and bf16 weights [out, in].
void bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_linear_supported(),
              "bf16_linear needs a CPU with AVX512_BF16 (and KVSERVE_CPU_ISA not avx2)");
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "bf16_linear takes bfloat16 x, weight and out");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "2-D tensors expected");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && out.size(0) == rows && out.size(1) == outs, "shape mismatch");
#ifdef KVSERVE_HAVE_BF16_KERNEL
  bf16_linear_rows(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), rows, in,
                   outs);
#endif
}

}  // namespace kvserve
