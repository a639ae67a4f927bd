// Group-wise 4-bit linear: float32 activations against asymmetric 4-bit weights in
// llama.cpp's Q4_1 format (groups of 32 input channels, a float16 scale d and minimum m
// per group, w = d * q + m with q in 0..15).
//
// Layout, per output row: in/2 bytes of nibbles, 16 bytes per group; byte j of a group
// holds element j in its low nibble and element j + 16 in its high nibble. params is
// [out, in/32, 2] float16 (d, m).
//
// y[r, n] = sum_g d[n,g] * (x[r, g] . q[n, g]) + m[n,g] * sum(x[r, g]): the minimum is
// applied once per group through the group sums of x (exact float sums, once per call).
//
// Up to eight rows (decode) the dot products are integer, as llama.cpp's Q4_1 x Q8_1: each
// activation group of 32 is quantized to int8 with its own scale (max|x| / 127), and
// u8 x s8 multiply-adds (vpmaddubsw) replace unpacking every weight to float, which made
// the float version compute-bound at a third of the memory rate. On CPUs with AVX512_VNNI
// (and an even group count) two groups go through one vpdpbusd: 64 codes against 64
// activations into 16 int32 lanes, about half the instructions per weight of the AVX2
// loop, which was still compute-bound at batch 1. More rows dequantize a tile of weight
// rows to float once and reuse it: exact activations, FMA-bound.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define KVSERVE_HAVE_VNNI_KERNEL 1
#endif

namespace kvserve {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupBytes = kGroup / 2;
// Activation rows up to this count take the integer path (decode steps); more rows
// dequantize a tile of weight rows to float once and reuse it, which is faster from 16
// rows on (bench/bench_kernels.py) and exact in the activations (prefill).
constexpr int64_t kIntegerMaxRows = 8;
// Activation rows that share one unpacked weight group on the integer path.
constexpr int64_t kRowBlock = 4;
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

// Activation rows quantized per group of 32 for the integer dot products: int8 values
// (x * 127 / max|x|, rounded to nearest even), the scale back (max|x| / 127), and the
// group's exact float sum for the minimum term, stored as (0, sum) pairs to line up with
// the weights' (d, m) pairs.
struct QuantizedRows {
  int64_t groups = 0;
  std::vector<int8_t> values;      // [rows, in]
  std::vector<float> scales;       // [rows, groups]
  std::vector<float> paired_sums;  // [rows, groups, 2]
};

template <typename scalar_t>
QuantizedRows quantize_rows(const scalar_t* x, int64_t rows, int64_t in) {
  QuantizedRows out;
  out.groups = in / kGroup;
  out.values.resize(rows * in);
  out.scales.resize(rows * out.groups);
  out.paired_sums.assign(rows * out.groups * 2, 0.f);
  for (int64_t at = 0; at < rows * out.groups; ++at) {
    const scalar_t* src = x + at * kGroup;
    int8_t* dst = out.values.data() + at * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) {
      const float value = static_cast<float>(src[j]);
      amax = std::max(amax, std::fabs(value));
      sum += value;
    }
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
#ifdef KVSERVE_AVX2
    // Round to nearest even (the default MXCSR mode), pack to int8 (values within +-127),
    // and undo the lane interleaving the two packs introduce.
    __m256i lanes[4];
    for (int j = 0; j < 4; ++j) {
      lanes[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 8 * j), _mm256_set1_ps(inverse)));
    }
    const __m256i words = _mm256_packs_epi32(lanes[0], lanes[1]);
    const __m256i words2 = _mm256_packs_epi32(lanes[2], lanes[3]);
    const __m256i bytes = _mm256_packs_epi16(words, words2);
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
#else
    for (int64_t j = 0; j < kGroup; ++j) dst[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(src[j]) * inverse));
#endif
    out.scales[at] = amax / 127.f;
    out.paired_sums[2 * at + 1] = sum;
  }
  return out;
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

// A group's 32 codes as bytes: elements 0-15 in the low lane, 16-31 in the high lane.
inline __m256i unpack_codes(const uint8_t* bytes) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// codes . x for one group as 8 float lanes: vpmaddubsw multiplies u8 codes by s8
// activations into int16 pairs (at most 2 x 15 x 127, no saturation), vpmaddwd sums
// those into int32; the sums are exact and exactly representable as floats.
inline __m256 group_dot_i8(__m256i codes, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(sums);
}

// One weight row against M int8-quantized activation rows, two groups per iteration on
// independent accumulators (one chain per group made the loop latency-bound), each
// group's codes unpacked and its (d, m) pair converted once for all rows. The minimum
// term of both groups is one 4-lane FMA of (d0, m0, d1, m1) with (0, sum0, 0, sum1).
template <int M>
inline void integer_dots(const QuantizedRows& x, int64_t first_row, const uint8_t* q,
                         const at::Half* params, float* out) {
  const int64_t groups = x.groups;
  const int8_t* values = x.values.data();
  const float* scales = x.scales.data();
  const float* paired = x.paired_sums.data();
  __m256 acc[M][2];
  __m128 bias[M];
  for (int m = 0; m < M; ++m) {
    acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    bias[m] = _mm_setzero_ps();
  }
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const __m128 dm =
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(params + 2 * g)));
    const __m256 d0 = _mm256_broadcastss_ps(dm);
    const __m256 d1 = _mm256_broadcastss_ps(_mm_movehl_ps(dm, dm));
    const __m256i c0 = unpack_codes(q + g * kGroupBytes);
    const __m256i c1 = unpack_codes(q + (g + 1) * kGroupBytes);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (first_row + m) * groups + g;
      const __m256 s0 = _mm256_mul_ps(group_dot_i8(c0, values + at * kGroup),
                                      _mm256_broadcast_ss(scales + at));
      const __m256 s1 = _mm256_mul_ps(group_dot_i8(c1, values + (at + 1) * kGroup),
                                      _mm256_broadcast_ss(scales + at + 1));
      acc[m][0] = _mm256_fmadd_ps(d0, s0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(d1, s1, acc[m][1]);
      bias[m] = _mm_fmadd_ps(dm, _mm_loadu_ps(paired + 2 * at), bias[m]);
    }
  }
  float tail[M] = {};
  if (g < groups) {  // an odd group count
    const float d = half_to_float(params[2 * g]);
    const float minimum = half_to_float(params[2 * g + 1]);
    const __m256i c0 = unpack_codes(q + g * kGroupBytes);
    for (int m = 0; m < M; ++m) {
      const int64_t at = (first_row + m) * groups + g;
      acc[m][0] = _mm256_fmadd_ps(_mm256_set1_ps(d * scales[at]),
                                  group_dot_i8(c0, values + at * kGroup), acc[m][0]);
      tail[m] = minimum * paired[2 * at + 1];
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 b = _mm_add_ps(bias[m], _mm_movehl_ps(bias[m], bias[m]));
    const float minimum_term = _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b))) + tail[m];
    out[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1])) + minimum_term;
  }
}

#ifdef KVSERVE_HAVE_VNNI_KERNEL
// The activation rows laid out for the VNNI loop. Two groups' codes (a, b) load as one
// register [a 0-15 | b 0-15 | a 16-31 | b 16-31] (the low nibbles of their 32 bytes, then
// the high ones), so their activations are stored in that order too, and the 16 int32
// lanes vpdpbusd yields (4 per 16 codes) are scaled by [sa x4, sb x4, sa x4, sb x4].
struct PairedRows {
  std::vector<int8_t> values;  // [rows, in], reordered per pair of groups
  std::vector<float> scales;   // [rows, groups / 2, 16] activation scales per lane
};

PairedRows pair_rows(const QuantizedRows& x, int64_t rows, int64_t in) {
  PairedRows paired;
  const int64_t pairs = x.groups / 2;
  paired.values.resize(rows * in);
  paired.scales.resize(rows * pairs * 16);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int8_t* a = x.values.data() + r * in + p * 2 * kGroup;
      const int8_t* b = a + kGroup;
      int8_t* dst = paired.values.data() + r * in + p * 2 * kGroup;
      std::copy(a, a + 16, dst);
      std::copy(b, b + 16, dst + 16);
      std::copy(a + 16, a + 32, dst + 32);
      std::copy(b + 16, b + 32, dst + 48);
      const float scale_a = x.scales[r * x.groups + 2 * p];
      const float scale_b = x.scales[r * x.groups + 2 * p + 1];
      float* lanes = paired.scales.data() + (r * pairs + p) * 16;
      for (int i = 0; i < 16; ++i) lanes[i] = (i / 4) % 2 == 0 ? scale_a : scale_b;
    }
  }
  return paired;
}

// One pair of groups (g, g + 1) against M rows: the codes are unpacked once (u8,
// vpdpbusd's unsigned operand) and each row adds one vpdpbusd, one conversion and one FMA
// by (weight scale x activation scale) per lane, and the minimum term's 4-lane FMA (as in
// the AVX2 loop) into that row's accumulators.
template <int M>
KVSERVE_VNNI_TARGET inline void pair_dots_vnni(const QuantizedRows& x, const PairedRows& paired,
                                               int64_t first_row, int64_t p, const uint8_t* q,
                                               const at::Half* params, __m512* acc, __m128* bias) {
  const int64_t groups = x.groups;
  const int64_t g = 2 * p;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i weight_scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroupBytes));
  const __m256i low = _mm256_and_si256(raw, nibble);
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  const __m128 dm = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(params + 2 * g)));
  const __m512 d = _mm512_permutexvar_ps(weight_scale_lanes, _mm512_castps128_ps512(dm));
  for (int m = 0; m < M; ++m) {
    const int64_t row = first_row + m;
    const __m512i dots = _mm512_dpbusd_epi32(
        _mm512_setzero_si512(), codes,
        _mm512_loadu_si512(paired.values.data() + row * groups * kGroup + g * kGroup));
    const __m512 scale = _mm512_mul_ps(d, _mm512_loadu_ps(paired.scales.data() + (row * groups / 2 + p) * 16));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[m]);
    bias[m] = _mm_fmadd_ps(dm, _mm_loadu_ps(x.paired_sums.data() + 2 * (row * groups + g)), bias[m]);
  }
}

// integer_dots for an even group count, a pair of groups per vpdpbusd; even and odd pairs
// feed separate accumulators (unrolled, so they stay in registers) to hide FMA latency.
template <int M>
KVSERVE_VNNI_TARGET inline void integer_dots_vnni(const QuantizedRows& x, const PairedRows& paired,
                                                  int64_t first_row, const uint8_t* q,
                                                  const at::Half* params, float* out) {
  const int64_t pairs = x.groups / 2;
  __m512 even[M], odd[M];
  __m128 bias_even[M], bias_odd[M];
  for (int m = 0; m < M; ++m) {
    even[m] = odd[m] = _mm512_setzero_ps();
    bias_even[m] = bias_odd[m] = _mm_setzero_ps();
  }
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    pair_dots_vnni<M>(x, paired, first_row, p, q, params, even, bias_even);
    pair_dots_vnni<M>(x, paired, first_row, p + 1, q, params, odd, bias_odd);
  }
  if (p < pairs) pair_dots_vnni<M>(x, paired, first_row, p, q, params, even, bias_even);
  for (int m = 0; m < M; ++m) {
    const __m128 both = _mm_add_ps(bias_even[m], bias_odd[m]);
    const __m128 b = _mm_add_ps(both, _mm_movehl_ps(both, both));
    const float minimum_term = _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + minimum_term;
  }
}
#endif

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

// One weight row as floats d * q + m (the many-row path's tile).
void dequantize_row(const uint8_t* q, const at::Half* params, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float d = half_to_float(params[2 * g]);
    const float minimum = half_to_float(params[2 * g + 1]);
    float* dst = out + g * kGroup;
#ifdef KVSERVE_AVX2
    const Group8 w = unpack_group(q + g * kGroupBytes);
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(dst + 8 * j,
                       _mm256_fmadd_ps(w.w[j], _mm256_set1_ps(d), _mm256_set1_ps(minimum)));
    }
#else
    unpack_group_scalar(q + g * kGroupBytes, dst);
    for (int64_t j = 0; j < kGroup; ++j) dst[j] = dst[j] * d + minimum;
#endif
  }
}

// Every activation row against each weight row while it is in L1: the weights stream from
// memory once per call whatever the row count. dots(r, take, q_n, params_n, out) computes
// rows [r, r + take) against one weight row.
template <typename scalar_t, typename Dots>
void for_each_weight_row(int64_t rows, int64_t in, int64_t outs, const uint8_t* q,
                         const at::Half* params, scalar_t* out, const Dots& dots) {
  const int64_t groups = in / kGroup;
  at::parallel_for(0, outs, 64, [&](int64_t begin, int64_t end) {
    float results[kRowBlock];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < rows; r += kRowBlock) {
        const int64_t take = std::min(kRowBlock, rows - r);
        dots(r, take, q + n * (in / 2), params + n * groups * 2, results);
        for (int64_t i = 0; i < take; ++i) out[(r + i) * outs + n] = results[i];
      }
    }
  });
}

template <typename scalar_t>
void integer_rows(const scalar_t* x, int64_t rows, int64_t in, int64_t outs, const uint8_t* q,
                  const at::Half* params, scalar_t* out) {
#ifdef KVSERVE_AVX2
  const QuantizedRows xq = quantize_rows(x, rows, in);
#ifdef KVSERVE_HAVE_VNNI_KERNEL
  if (int8_vnni_supported() && xq.groups % 2 == 0) {
    const PairedRows paired = pair_rows(xq, rows, in);
    for_each_weight_row(rows, in, outs, q, params, out,
                        [&](int64_t r, int64_t take, const uint8_t* qn, const at::Half* pn, float* dots) {
                          switch (take) {
                            case 4: integer_dots_vnni<4>(xq, paired, r, qn, pn, dots); break;
                            case 3: integer_dots_vnni<3>(xq, paired, r, qn, pn, dots); break;
                            case 2: integer_dots_vnni<2>(xq, paired, r, qn, pn, dots); break;
                            default: integer_dots_vnni<1>(xq, paired, r, qn, pn, dots); break;
                          }
                        });
    return;
  }
#endif
  for_each_weight_row(rows, in, outs, q, params, out,
                      [&](int64_t r, int64_t take, const uint8_t* qn, const at::Half* pn, float* dots) {
                        switch (take) {
                          case 4: integer_dots<4>(xq, r, qn, pn, dots); break;
                          case 3: integer_dots<3>(xq, r, qn, pn, dots); break;
                          case 2: integer_dots<2>(xq, r, qn, pn, dots); break;
                          default: integer_dots<1>(xq, r, qn, pn, dots); break;
                        }
                      });
#else
  TORCH_CHECK(false, "the integer int4 path needs AVX2");
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

// out = x @ W.T for x [rows, in] and out [rows, out] both float32 or both bfloat16 (a bf16
// model's decode rows are quantized straight from bf16; the many-row path computes in
// float32 and converts at its ends).
void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& params) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qweight, "qweight");
  check_cpu_contiguous(params, "params");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and out must both be float32 or both bfloat16");
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
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const at::Half* pp = params.data_ptr<at::Half>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  bool integer = rows <= kIntegerMaxRows;
#ifndef KVSERVE_AVX2
  integer = false;
#endif
  if (integer && bf16) {
    integer_rows(x.data_ptr<at::BFloat16>(), rows, in, outs, qp, pp, out.data_ptr<at::BFloat16>());
  } else if (integer) {
    integer_rows(x.data_ptr<float>(), rows, in, outs, qp, pp, out.data_ptr<float>());
  } else if (bf16) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out32 = at::empty({rows, outs}, x32.options());
    tiled_rows(x32.data_ptr<float>(), rows, in, outs, qp, pp, out32.data_ptr<float>());
    out.copy_(out32);
  } else {
    tiled_rows(x.data_ptr<float>(), rows, in, outs, qp, pp, out.data_ptr<float>());
  }
}

}  // namespace kvserve
