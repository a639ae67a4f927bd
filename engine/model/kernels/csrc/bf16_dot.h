// bf16 dot products on CPUs with AVX512_BF16 (vdpbf16ps: 32 products per instruction,
// float32 sums): the target attribute every bf16 kernel compiles under (bf16_linear.cpp,
// lora.cpp), and LoRA's shrink, one weight row against a few activation rows. Compiled for
// AVX512_BF16 whatever the build machine; callers check bf16_linear_supported() (ops.h)
// before calling.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KVSERVE_HAVE_BF16_KERNEL 1
#endif

namespace kvserve {

#ifdef KVSERVE_HAVE_BF16_KERNEL
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

#endif  // KVSERVE_HAVE_BF16_KERNEL

}  // namespace kvserve
