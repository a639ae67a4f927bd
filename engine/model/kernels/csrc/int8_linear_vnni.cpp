// Few-row int8 linear with integer dot products on CPUs with AVX512_VNNI: vpdpbusd sums
// 64 u8 x s8 products into 16 int32 lanes in one instruction, where the float kernel
// (int8_linear.cpp) widens every weight to float32 first and runs out of issue slots
// before memory runs out of bytes.
//
// Activations are quantized per group of 64 to int8 (scale max|x| / 127, round to nearest
// even), as llama.cpp's Q8_0 does for its integer paths: a finer grid than fbgemm's
// per-tensor 7-bit one that larger batches take. Weights are the same symmetric per-row
// int8 the float kernel reads. vpdpbusd wants one unsigned operand, so each weight byte
// is flipped to w + 128 in a register (xor 0x80); the 128 * sum(x) that adds to every dot
// product is one number per activation row, taken off at the end.
//
// Compiled for AVX512_VNNI whatever the build machine (a target attribute) and called only
// where the CPU has it (int8_vnni_supported), so one build serves every x86 CPU.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "lane_sums.h"
#include "ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define KVSERVE_HAVE_VNNI_KERNEL 1
#endif

namespace kvserve {

bool int8_vnni_supported() {
#ifdef KVSERVE_HAVE_VNNI_KERNEL
  static const bool supported =
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      avx512_kernels_allowed();
  return supported;
#else
  return false;
#endif
}

bool int8_integer_supported() { return int8_vnni_supported() || int8_integer_avx2_supported(); }

#ifdef KVSERVE_HAVE_VNNI_KERNEL
namespace {

constexpr int64_t kGroup = 64;  // activations per scale: one vpdpbusd's worth

// The activation rows as int8 groups: values [rows, in], scales [rows, groups] and, per
// row, 128 * sum_g scale_g * sum(values_g) (what the weights' +128 adds).
struct QuantizedRows {
  int64_t groups = 0;
  std::vector<int8_t> values;
  std::vector<float> scales;
  std::vector<float> offsets;
};

KVSERVE_VNNI_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KVSERVE_VNNI_TARGET inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename scalar_t>
KVSERVE_VNNI_TARGET QuantizedRows quantize_rows(const scalar_t* x, int64_t rows, int64_t in) {
  QuantizedRows q;
  q.groups = in / kGroup;
  q.values.resize(rows * in);
  q.scales.resize(rows * q.groups);
  q.offsets.assign(rows, 0.f);
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float offset = 0.f;
    for (int64_t g = 0; g < q.groups; ++g) {
      const int64_t at = r * in + g * kGroup;
      __m512 v[4];
      __m512 amax = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = load16(x + at + 16 * j);
        amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[j]));
      }
      const float largest = _mm512_reduce_max_ps(amax);
      const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        // Nearest even (the default rounding mode); |x| * 127 / max|x| <= 127, no clamp.
        const __m512i ints = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], inverse));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q.values.data() + at + 16 * j),
                         _mm512_cvtepi32_epi8(ints));
        sum = _mm512_add_epi32(sum, ints);
      }
      const float scale = largest / 127.f;
      q.scales[r * q.groups + g] = scale;
      offset += scale * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
    q.offsets[r] = 128.f * offset;
  }
  return q;
}

// out[m][r] = sum_g scale[m, g] * (x[m, g] . (w[r]_g + 128)) - offset[m] for M activation
// rows against R consecutive weight rows (R <= 4): each 64-weight chunk is flipped once and
// feeds every row, and the M x R sums are independent chains, summed at the end by one
// fixed lane tree per output (lane_sums.h), so a row's result does not depend on its block.
// `ahead`: where to ask for lines into L2 (common.h's prefetch_plan()), one per chunk read;
// null for none.
template <int M, int R>
KVSERVE_VNNI_TARGET inline void dot_block_vnni(const QuantizedRows& q, int64_t first_row,
                                               int64_t in, const int8_t* w, const char* ahead,
                                               float out[][4]) {
  const int64_t groups = q.groups;
  const int8_t* x = q.values.data() + first_row * in;
  const float* scales = q.scales.data() + first_row * groups;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  __m512i wg[R];
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) {
      if (ahead != nullptr) _mm_prefetch(ahead + r * in + g * kGroup, _MM_HINT_T1);
      wg[r] = _mm512_xor_si512(_mm512_loadu_si512(w + r * in + g * kGroup), flip);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i xg = _mm512_loadu_si512(x + m * in + g * kGroup);
      const __m512 scale = _mm512_set1_ps(scales[m * groups + g]);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wg[r], xg);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 sums = lane_sums4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    _mm_storeu_ps(out[m], _mm_sub_ps(sums, _mm_set1_ps(q.offsets[first_row + m])));
  }
}

template <int R>
KVSERVE_VNNI_TARGET inline void dot_rows_vnni(int64_t rows, const QuantizedRows& q,
                                              int64_t first_row, int64_t in, const int8_t* w,
                                              const char* ahead, float out[][4]) {
  switch (rows) {
    case 4: dot_block_vnni<4, R>(q, first_row, in, w, ahead, out); break;
    case 3: dot_block_vnni<3, R>(q, first_row, in, w, ahead, out); break;
    case 2: dot_block_vnni<2, R>(q, first_row, in, w, ahead, out); break;
    default: dot_block_vnni<1, R>(q, first_row, in, w, ahead, out); break;
  }
}

// Output blocks [begin, end) of four weight rows (the last may be short), every activation
// row against each block while it is in L1, four rows at a time; out = dot * scale[n].
template <typename scalar_t>
KVSERVE_VNNI_TARGET void vnni_blocks(scalar_t* op, const QuantizedRows& q, const int8_t* wp,
                                     const float* sp, int64_t rows, int64_t in, int64_t outs,
                                     int64_t begin, int64_t end) {
  const char* stop = reinterpret_cast<const char*>(wp + std::min(end * 4, outs) * in);
  float out[4][4];
  for (int64_t block = begin; block < end; ++block) {
    const int64_t n = block * 4;
    const int64_t width = std::min<int64_t>(4, outs - n);
    const int8_t* w = wp + n * in;
    const char* ahead = reinterpret_cast<const char*>(w) + prefetch_plan().distance;
    if (ahead + width * in > stop) ahead = nullptr;
    for (int64_t m = 0; m < rows; m += 4) {
      const int64_t take = std::min<int64_t>(4, rows - m);
      const char* once = m == 0 ? ahead : nullptr;  // later rows find the lines in L1
      switch (width) {
        case 4: dot_rows_vnni<4>(take, q, m, in, w, once, out); break;
        case 3: dot_rows_vnni<3>(take, q, m, in, w, once, out); break;
        case 2: dot_rows_vnni<2>(take, q, m, in, w, once, out); break;
        default: dot_rows_vnni<1>(take, q, m, in, w, once, out); break;
      }
      for (int64_t r = 0; r < take; ++r) {
        for (int64_t j = 0; j < width; ++j) op[(m + r) * outs + n + j] = out[r][j] * sp[n + j];
      }
    }
  }
}

template <typename scalar_t>
void vnni_rows(scalar_t* op, const scalar_t* xp, const int8_t* wp, const float* sp, int64_t rows,
               int64_t in, int64_t outs) {
  const QuantizedRows q = quantize_rows(xp, rows, in);
  // Each thread takes a contiguous range of blocks: one stream through the weights apiece.
  at::parallel_for(0, (outs + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    vnni_blocks(op, q, wp, sp, rows, in, outs, begin, end);
  });
}

}  // namespace
#endif

// out[m, n] = scales[n] * (q(x[m]) . weight[n]) for x [rows, in] (float32 or bfloat16, out
// alike) quantized per group of 64, and symmetric per-row int8 weights [out, in] in
// [-127, 127]. With VNNI where the CPU has it, else its AVX2 form (int8_linear_avx2.cpp).
void int8_linear_vnni(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& scales) {
  TORCH_CHECK(int8_integer_supported(), "the integer int8 kernel needs AVX2 or AVX512_VNNI");
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and out must both be float32 or both bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "weight must be int8 and scales float32");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "2-D tensors expected");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
  TORCH_CHECK(in % 64 == 0, "int8_linear_vnni needs in_features divisible by 64, not ", in);
  TORCH_CHECK(weight.size(1) == in && scales.numel() == outs && out.size(0) == rows &&
                  out.size(1) == outs,
              "shape mismatch");
  if (!int8_vnni_supported()) {
    int8_linear_integer_avx2(out, x, weight, scales);
    return;
  }
#ifdef KVSERVE_HAVE_VNNI_KERNEL
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    vnni_rows(out.data_ptr<float>(), x.data_ptr<float>(), wp, sp, rows, in, outs);
  } else {
    vnni_rows(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), wp, sp, rows, in, outs);
  }
#endif
}

}  // namespace kvserve
