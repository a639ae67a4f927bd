// Decode attention's two products on a bf16 KV cache with vdpbf16ps (AVX512_BF16): the
// cache rows are used as they lie, never widened to float32, and each instruction does 32
// products where the float32 loops do 16 plus the widening. A 32-sequence step of the
// embedded model spent 30% of its time in decode attention, and even with the cache hot
// in L3 the float32 loops were bound by their own instruction count.
//
// - Scores: the query heads' bf16 rows against each key row, float32 sums, the softmax
//   scale applied to each sum (the products are exact: a bf16 x bf16 product fits a
//   float32, so only the summation order differs from the float32 loops').
// - Values: the softmax weights rounded to bf16 (as a bf16 GEMM or the bf16 prefill kernel
//   rounds its probabilities), two tokens per instruction: each weight pair (p_t, p_t+1)
//   against the two value rows interleaved column by column.
//
// Compiled for AVX512_BF16 whatever the build machine; paged_attention.cpp takes these
// only where bf16_linear_supported() and head_dim is 32, 64 or 128.
#pragma once

#include <cstdint>
#include <cstring>

#include "bf16_dot.h"  // KVSERVE_BF16_TARGET, KVSERVE_HAVE_BF16_KERNEL
#include "lane_sums.h"

namespace kvserve::bf16_attention {

#ifdef KVSERVE_HAVE_BF16_KERNEL

// scores[g * stride + t] = scale * (q[g] . rows[t]) for t < n and the G query heads of q
// ([G][32 * NC] bf16): four keys at a time, each query chunk loaded once for the four.
template <int G, int NC>
KVSERVE_BF16_TARGET void scores(const uint16_t* q, const uint16_t* const* rows, int64_t n,
                                float* out, int64_t stride, float scale) {
  constexpr int64_t kDim = 32 * NC;
  const __m128 factor = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      __m512bh query[G];
      for (int g = 0; g < G; ++g) query[g] = (__m512bh)_mm512_loadu_si512(q + g * kDim + 32 * c);
      for (int j = 0; j < 4; ++j) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(rows[t + j] + 32 * c);
        for (int g = 0; g < G; ++g) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], query[g], k);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m128 sums = lane_sums4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      _mm_storeu_ps(out + g * stride + t, _mm_mul_ps(sums, factor));
    }
  }
  for (; t < n; ++t) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(rows[t] + 32 * c);
      for (int g = 0; g < G; ++g) {
        const __m512bh query = (__m512bh)_mm512_loadu_si512(q + g * kDim + 32 * c);
        acc[g] = _mm512_dpbf16_ps(acc[g], query, k);
      }
    }
    for (int g = 0; g < G; ++g) out[g * stride + t] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
}

// The rows of a [groups, n] float32 weight matrix rounded to bf16 into dst ([groups][padded],
// padded = n rounded up to even, the pad a zero weight).
KVSERVE_BF16_TARGET inline void round_weights(const float* p, int64_t n, int64_t groups,
                                              int64_t padded, uint16_t* dst) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* row = p + g * n;
    uint16_t* to = dst + g * padded;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + t)));
    }
    if (t < padded) {
      const __mmask16 keep = static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m256i tail = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, row + t));
      const __mmask16 store = static_cast<__mmask16>((1u << (padded - t)) - 1);
      _mm256_mask_storeu_epi16(to + t, store, tail);
    }
  }
}

// The accumulators' column order back to the row's: after unpacklo/hi of two rows a "lo"
// lane i holds column 8 * (i / 4) + i % 4 of its 32-column chunk and a "hi" lane that + 4.
// kUnpermute[h] gathers columns 16h..16h+15 from (lo, hi) (indices 16+ pick from hi).
alignas(64) inline constexpr int32_t kUnpermute[2][16] = {
    {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
    {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31},
};

// out[g][column, column + 32 * SLICE) = sum_t p[g][t] * rows[t][same columns] for t < n,
// p the bf16 weights of round_weights ([G][padded]); `zero_row` stands in for the token
// after an odd n (its weight is the zero pad).
template <int G, int SLICE>
KVSERVE_BF16_TARGET void values(float* out, const uint16_t* p, int64_t padded,
                                const uint16_t* const* rows, int64_t n, int64_t head_dim,
                                int64_t column, const uint16_t* zero_row) {
  __m512 acc[G][SLICE][2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < SLICE; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    const uint16_t* first = rows[t] + column;
    const uint16_t* second = t + 1 < n ? rows[t + 1] + column : zero_row;
    __m512bh weight[G];
    for (int g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, p + g * padded + t, sizeof(pair));
      weight[g] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int c = 0; c < SLICE; ++c) {
      const __m512i a = _mm512_loadu_si512(first + 32 * c);
      const __m512i b = _mm512_loadu_si512(second + 32 * c);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < G; ++g) {
        acc[g][c][0] = _mm512_dpbf16_ps(acc[g][c][0], weight[g], lo);
        acc[g][c][1] = _mm512_dpbf16_ps(acc[g][c][1], weight[g], hi);
      }
    }
  }
  const __m512i first_half = _mm512_load_si512(kUnpermute[0]);
  const __m512i second_half = _mm512_load_si512(kUnpermute[1]);
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < SLICE; ++c) {
      float* dst = out + g * head_dim + column + 32 * c;
      _mm512_storeu_ps(dst, _mm512_permutex2var_ps(acc[g][c][0], first_half, acc[g][c][1]));
      _mm512_storeu_ps(dst + 16,
                       _mm512_permutex2var_ps(acc[g][c][0], second_half, acc[g][c][1]));
    }
  }
}

#endif  // KVSERVE_HAVE_BF16_KERNEL

}  // namespace kvserve::bf16_attention
