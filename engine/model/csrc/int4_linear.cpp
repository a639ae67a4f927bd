// Group-wise 4-bit linear: float32 activations against asymmetric 4-bit weights in
// llama.cpp's Q4_1 format (groups of 32 input channels, a float16 scale d and minimum m
// per group, w = d * q + m with q in 0..15).
//
// Layout, per output row: in/2 bytes of nibbles, 16 bytes per group; byte j of a group
// holds element j in its low nibble and element j + 16 in its high nibble. params is
// [out, in/32, 2] float16 (d, m).
//
// y[r, n] = sum_g d[n,g] * (x[r, g] . q[n, g]) + m[n,g] * sum(x[r, g]): the minimum is
// applied once per group through the group sums of x, computed once per call.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvserve {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kGroup / 2;
// Activation rows up to this count take the fused unpack-and-dot path; more rows
// dequantize a tile of weight rows once and reuse it for every activation row.
constexpr int64_t kFusedMaxRows = 4;
// Weight rows dequantized per tile on the many-row path (a 16 x 1,536 float tile is
// 96 KiB: the L2 of one core).
constexpr int64_t kTileRows = 16;

inline float half_to_float(const at::Half h) {
#ifdef KVSERVE_AVX2
  return _cvtsh_ss(h.x);  // one F16C instruction instead of c10's bit manipulation
#else
  return static_cast<float>(h);
#endif
}

// The group's 32 weights as integers 0..15, in element order.
inline void unpack_group_scalar(const uint8_t* bytes, float* q) {
  for (int64_t j = 0; j < kGroupBytes; ++j) {
    q[j] = static_cast<float>(bytes[j] & 0x0F);
    q[j + kGroupBytes] = static_cast<float>(bytes[j] >> 4);
  }
}

#ifdef KVSERVE_AVX2
struct Group8 {
  __m256 w[4];  // elements 0-7, 8-15, 16-23, 24-31 of the group, as floats 0..15
};

inline Group8 unpack_group(const uint8_t* bytes) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  Group8 g;
  g.w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  g.w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  g.w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  g.w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  return g;
}

// x[0:32] . q as 8 partial lanes, two FMA chains.
inline __m256 group_dot(const float* x, const Group8& g) {
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x), g.w[0]);
  __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + 8), g.w[1]);
  a = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), g.w[2], a);
  b = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), g.w[3], b);
  return _mm256_add_ps(a, b);
}

// One weight row against M activation rows, unpacking each group once for all rows.
template <int M>
inline void fused_row(const float* x, int64_t in, const float* xsum, int64_t groups,
                      const uint8_t* q, const at::Half* params, float* out) {
  __m256 acc[M];
  float bias[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    bias[m] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const Group8 w = unpack_group(q + g * kGroupBytes);
    const __m256 d = _mm256_set1_ps(half_to_float(params[2 * g]));
    const float minimum = half_to_float(params[2 * g + 1]);
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm256_fmadd_ps(d, group_dot(x + m * in + g * kGroup, w), acc[m]);
      bias[m] += minimum * xsum[m * groups + g];
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum8(acc[m]) + bias[m];
}

// MR activation rows against NR dequantized weight rows (row stride in): MR x NR
// accumulators, each x and w vector loaded once per 8 columns.
template <int MR, int NR>
inline void tile_dots(const float* x, int64_t ldx, const float* w, int64_t in, float* out,
                      int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * in + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m * ldo + n] = hsum8(acc[m][n]);
}

template <int MR>
inline void tile_dots_rows(const float* x, int64_t ldx, const float* w, int64_t in,
                           int64_t rows, float* out, int64_t ldo) {
  int64_t n = 0;
  for (; n + 3 <= rows; n += 3) tile_dots<MR, 3>(x, ldx, w + n * in, in, out + n, ldo);
  for (; n < rows; ++n) tile_dots<MR, 1>(x, ldx, w + n * in, in, out + n, ldo);
}
#endif

// Weight row n of the call as floats d * q + m (the many-row path's tile, and the
// portable path).
void dequantize_row(const uint8_t* q, const at::Half* params, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float d = half_to_float(params[2 * g]);
    const float minimum = half_to_float(params[2 * g + 1]);
    float* dst = out + g * kGroup;
    unpack_group_scalar(q + g * kGroupBytes, dst);
    for (int64_t j = 0; j < kGroup; ++j) dst[j] = dst[j] * d + minimum;
  }
}

void fused_rows(const float* x, int64_t rows, int64_t in, int64_t outs, const uint8_t* q,
                const at::Half* params, float* out) {
#ifdef KVSERVE_AVX2
  const int64_t groups = in / kGroup;
  std::vector<float> xsum(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) s += x[r * in + g * kGroup + j];
      xsum[r * groups + g] = s;
    }
  at::parallel_for(0, outs, 64, [&](int64_t begin, int64_t end) {
    float dots[kFusedMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* qn = q + n * (in / 2);
      const at::Half* pn = params + n * groups * 2;
      switch (rows) {
        case 4: fused_row<4>(x, in, xsum.data(), groups, qn, pn, dots); break;
        case 3: fused_row<3>(x, in, xsum.data(), groups, qn, pn, dots); break;
        case 2: fused_row<2>(x, in, xsum.data(), groups, qn, pn, dots); break;
        default: fused_row<1>(x, in, xsum.data(), groups, qn, pn, dots); break;
      }
      for (int64_t r = 0; r < rows; ++r) out[r * outs + n] = dots[r];
    }
  });
#else
  TORCH_CHECK(false, "the fused int4 path needs AVX2");
#endif
}

void tiled_rows(const float* x, int64_t rows, int64_t in, int64_t outs, const uint8_t* q,
                const at::Half* params, float* out) {
  const int64_t groups = in / kGroup;
  const int64_t tiles = (outs + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kTileRows * in);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int64_t count = std::min(kTileRows, outs - n0);
      for (int64_t n = 0; n < count; ++n) {
        dequantize_row(q + (n0 + n) * (in / 2), params + (n0 + n) * groups * 2, groups,
                       tile.data() + n * in);
      }
      float* dst = out + n0;
#ifdef KVSERVE_AVX2
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        tile_dots_rows<4>(x + r * in, in, tile.data(), in, count, dst + r * outs, outs);
      for (; r < rows; ++r)
        tile_dots_rows<1>(x + r * in, in, tile.data(), in, count, dst + r * outs, outs);
#else
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < count; ++n) {
          float acc = 0.f;
          for (int64_t k = 0; k < in; ++k) acc += x[r * in + k] * tile[n * in + k];
          dst[r * outs + n] = acc;
        }
#endif
    }
  });
}

}  // namespace

void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& params) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qweight, "qweight");
  check_cpu_contiguous(params, "params");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "x and out must be float32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "qweight must be uint8");
  TORCH_CHECK(params.scalar_type() == at::kHalf, "params must be float16");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = qweight.size(0);
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup);
  TORCH_CHECK(qweight.size(1) == in / 2, "qweight must be [out, in / 2]");
  TORCH_CHECK(params.dim() == 3 && params.size(0) == outs && params.size(1) == in / kGroup &&
                  params.size(2) == 2,
              "params must be [out, in / 32, 2]");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == outs, "out must be [rows, out]");
  if (rows == 0) return;
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const at::Half* pp = params.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  bool fused = rows <= kFusedMaxRows;
#ifndef KVSERVE_AVX2
  fused = false;
#endif
  if (fused) {
    fused_rows(xp, rows, in, outs, qp, pp, op);
  } else {
    tiled_rows(xp, rows, in, outs, qp, pp, op);
  }
}

}  // namespace kvserve
