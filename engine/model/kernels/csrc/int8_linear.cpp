// Few-row int8 linear: float32 activations against symmetric per-row int8 weights, for
// decode steps where the cost is streaming the weights from memory once.

#include <ATen/Dispatch.h>

#include <algorithm>

#include "common.h"
#include "ops.h"

namespace kvserve {

#ifdef KVSERVE_AVX2
// out[m] = x[m] . w for M activation rows (row stride ldx) against one int8 weight row,
// n a multiple of 32. Each 32-weight chunk is loaded and widened to float once and feeds
// every row, two FMA chains per row.
template <int M>
inline void dot_rows_i8(const float* x, int64_t ldx, const int8_t* w, int64_t n, float* out) {
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 32) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m128i lo = _mm256_castsi256_si128(raw);
    const __m128i hi = _mm256_extracti128_si256(raw, 1);
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * ldx + k;
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w1, acc[m][1]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w2, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w3, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
}

// One activation row: four independent FMA chains, so the loop is bound by memory rather
// than by FMA latency.
template <>
inline void dot_rows_i8<1>(const float* x, int64_t, const int8_t* w, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t k = 0; k < n; k += 32) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m128i lo = _mm256_castsi256_si128(raw);
    const __m128i hi = _mm256_extracti128_si256(raw, 1);
    const __m256i parts[4] = {
        _mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
        _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
    for (int j = 0; j < 4; ++j) {
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * j), _mm256_cvtepi32_ps(parts[j]), acc[j]);
    }
  }
  out[0] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}
#endif

inline float dot_f32_i8_any(const float* x, const int8_t* w, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += x[k] * static_cast<float>(w[k]);
  return acc;
}

// out[m, n] = scales[n] * (x[m] . weight[n]) for float32 x [rows, in] and symmetric
// per-row int8 weights [out, in]. Built for decode steps of a few rows, where the cost is
// streaming the weights from memory once: each thread walks a contiguous range of weight
// rows and applies every activation row to a weight row while it is in L1.
void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& scales) {
  check_float_rows(out, x);
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be float32");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && out.size(0) == rows && out.size(1) == outs, "shape mismatch");
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  bool vectorised = false;
#ifdef KVSERVE_AVX2
  vectorised = in % 32 == 0;
#endif
  for_each_weight_row(
      rows, outs, in, wp,
      [&](auto M, int64_t m, const int8_t* w, float* dots) {
        const float* xm = xp + m * in;
#ifdef KVSERVE_AVX2
        if (vectorised) {
          dot_rows_i8<decltype(M)::value>(xm, in, w, in, dots);
          return;
        }
#endif
        for (int r = 0; r < decltype(M)::value; ++r) dots[r] = dot_f32_i8_any(xm + r * in, w, in);
      },
      [&](int64_t m, int64_t n, float dot) { op[m * outs + n] = dot * sp[n]; });
}

}  // namespace kvserve
