// Few-row bf16 linear on CPUs with AVX512_BF16: bf16 activations against bf16 weights,
// float32 accumulation (vdpbf16ps: 32 products per instruction), bf16 out. Decode steps
// of one to a few rows, where the cost is streaming the weights from memory once.
//
// Compiled for AVX512_BF16 whatever the build machine (a target attribute), and only
// called where the CPU has it: bf16_linear_supported() reads the CPU's features at run
// time, so one build serves AVX2-only and AVX-512 machines alike.

#include <algorithm>
#include <cstring>

#include "common.h"
#include "ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KVSERVE_HAVE_BF16_KERNEL 1
#endif

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

// out[m] = x[m] . w for M activation rows (row stride ldx) against one bf16 weight row of
// n elements. Each 32-weight chunk is loaded once and feeds every row; two accumulator
// chains per row hide the dot-product latency; the tail is a masked load (zeros add 0).
template <int M>
KVSERVE_BF16_TARGET inline void dot_rows_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                              int64_t n, float* out) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int m = 0; m < M; ++m) {
      const uint16_t* xm = x + m * ldx + k;
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xm), w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
    }
  }
  for (; k < n; k += 32) {
    const int64_t left = std::min<int64_t>(32, n - k);
    const __mmask32 keep = left == 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    const __m512bh wk = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xk = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + m * ldx + k);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xk, wk);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

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
  // No prefetch: it measured no gain for bf16 rows (common.h, kPrefetchBytes).
  for_each_weight_row(
      rows, outs, in, wp, false,
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
