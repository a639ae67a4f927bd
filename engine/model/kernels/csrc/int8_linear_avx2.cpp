// The VNNI int8 kernel's math (int8_linear_vnni.cpp) on CPUs without VNNI: activations
// rounded to int8 per group of 64 exactly as there, exact integer dot products, then the
// group and row scales, so AVX2 and VNNI machines compute the same int8 numbers. The float
// kernel (int8_linear.cpp) it replaces there takes twelve instructions per 32 weights, this
// one four; yet it measured only 5-10% faster at one decode row (every AVX-512 path off,
// docs/BENCHMARKS.md session 11): one core's 256-bit streaming, not compute, bounds both.
//
// vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pair sums, so the
// activation's magnitude is the unsigned side and its sign moves onto the weight
// (vpsignb): |x| * sign(x) w = x w, and a pair is at most 2 * 127 * 127 < 2^15. That needs
// weights in [-127, 127], which symmetric per-row quantization gives (max|w| maps to 127).

#include <algorithm>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvserve {

#ifdef KVSERVE_AVX2
namespace {

constexpr int64_t kGroup = 64;  // activations per scale, as in the VNNI kernel

// The activation rows as int8 groups: values and their magnitudes [rows, in], scales
// [rows, groups].
struct SignedRows {
  int64_t groups = 0;
  std::vector<int8_t> values;
  std::vector<uint8_t> magnitudes;
  std::vector<float> scales;
};

// 32 floats rounded to int8 in order (the packs interleave 128-bit lanes; the permute
// undoes it). |x| * 127 / max|x| <= 127: the saturating packs never clamp.
inline __m256i round_to_bytes(const __m256* v, __m256 inverse) {
  __m256i ints[4];
  for (int j = 0; j < 4; ++j) ints[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                           _mm256_packs_epi32(ints[2], ints[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename scalar_t>
SignedRows quantize_signed(const scalar_t* x, int64_t rows, int64_t in) {
  SignedRows q;
  q.groups = in / kGroup;
  q.values.resize(rows * in);
  q.magnitudes.resize(rows * in);
  q.scales.resize(rows * q.groups);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t at = 0; at < rows * q.groups; ++at) {
    const scalar_t* src = x + at * kGroup;
    __m256 v[8];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      v[j] = load8(src + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    const float largest = *std::max_element(lanes, lanes + 8);
    // Nearest even (the default rounding mode), from the same quotient as the VNNI kernel.
    const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = round_to_bytes(v + 4 * half, inverse);
      const int64_t offset = at * kGroup + 32 * half;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.values.data() + offset), bytes);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.magnitudes.data() + offset),
                          _mm256_abs_epi8(bytes));
    }
    q.scales[at] = largest / 127.f;
  }
  return q;
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// out[m] = sum_g scale[m, g] * (x[m, g] . w_g) for M activation rows against one weight
// row: each 64-weight group is loaded once and feeds every row.
template <int M>
inline void dot_rows_avx2(const SignedRows& q, int64_t first_row, int64_t in, const int8_t* w,
                          float* out) {
  const int64_t groups = q.groups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w0 = load32(w + g * kGroup);
    const __m256i w1 = load32(w + g * kGroup + 32);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (first_row + m) * in + g * kGroup;
      const __m256i s0 = _mm256_sign_epi8(w0, load32(q.values.data() + at));
      const __m256i s1 = _mm256_sign_epi8(w1, load32(q.values.data() + at + 32));
      const __m256i p0 = _mm256_maddubs_epi16(load32(q.magnitudes.data() + at), s0);
      const __m256i p1 = _mm256_maddubs_epi16(load32(q.magnitudes.data() + at + 32), s1);
      const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
      const float scale = q.scales[(first_row + m) * groups + g];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(scale), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum8(acc[m]);
}

template <typename scalar_t>
void avx2_rows(scalar_t* op, const scalar_t* xp, const int8_t* wp, const float* sp,
               int64_t rows, int64_t in, int64_t outs) {
  const SignedRows q = quantize_signed(xp, rows, in);
  for_each_weight_row(
      rows, outs, in, wp,
      [&](auto M, int64_t m, const int8_t* w, float* dots) {
        dot_rows_avx2<decltype(M)::value>(q, m, in, w, dots);
      },
      [&](int64_t m, int64_t n, float dot) { op[m * outs + n] = static_cast<scalar_t>(dot * sp[n]); });
}

}  // namespace
#endif

bool int8_integer_avx2_supported() {
#ifdef KVSERVE_AVX2
  return true;
#else
  return false;
#endif
}

// int8_linear_vnni's contract (checked there), for CPUs without VNNI.
void int8_linear_integer_avx2(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales) {
#ifdef KVSERVE_AVX2
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  if (x.scalar_type() == at::kFloat) {
    avx2_rows(out.data_ptr<float>(), x.data_ptr<float>(), wp, sp, rows, in, outs);
  } else {
    avx2_rows(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), wp, sp, rows, in, outs);
  }
#else
  TORCH_CHECK(false, "the integer int8 kernel needs AVX2");
#endif
}

}  // namespace kvserve
