// Horizontal sums of AVX-512 float32 vectors for the few-row kernels that block four weight
// rows together (bf16_linear.cpp, int8_linear_vnni.cpp). Compiled for AVX-512F whatever the
// build machine (a target attribute); callers run only where their own kernel's features
// (a superset) are present.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace kvserve {

// [sum(a), sum(b), sum(c), sum(d)]: each vector's 16 lanes summed by one fixed tree,
// whatever vectors sit beside it, so a result does not depend on the block it came in.
__attribute__((target("avx512f"))) inline __m128 lane_sums4(__m512 a, __m512 b, __m512 c,
                                                            __m512 d) {
  // Fold each vector's four 128-bit quarters to one: quarter q of abcd is (a, b, c, d)[q]'s
  // (q0 + q2) + (q1 + q3).
  const __m512 ab =
      _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd =
      _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const __m512 abcd =
      _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // Then the four floats of each quarter, and lane 0 of each quarter is its vector's sum.
  __m512 sums = _mm512_add_ps(abcd, _mm512_permute_ps(abcd, 0x4E));
  sums = _mm512_add_ps(sums, _mm512_permute_ps(sums, 0xB1));
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, sums));
}

}  // namespace kvserve
#endif
