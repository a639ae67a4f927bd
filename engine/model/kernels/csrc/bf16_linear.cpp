// Few-row bf16 linear on CPUs with AVX512_BF16: bf16 activations against bf16 weights,
// float32 accumulation (vdpbf16ps: 32 products per instruction), bf16 out. Decode steps
// of one to a few rows, where the cost is streaming the weights from memory once.
//
// Compiled for AVX512_BF16 whatever the build machine (a target attribute), and only
// called where the CPU has it: bf16_linear_supported() reads the CPU's features at run
// time, so one build serves AVX2-only and AVX-512 machines alike.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "bf16_dot.h"  // KVSERVE_BF16_TARGET
#include "common.h"
#include "lane_sums.h"
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

// Four float32 -> bf16 stored at dst, each rounded as to_bf16 rounds it (nearest even, a
// NaN kept and made quiet): one store for a full block's row instead of four scalar
// conversions (~10% of an 8-row call).
KVSERVE_BF16_TARGET inline void store_bf16x4(uint16_t* dst, const float* src) {
  const __m128i bits = _mm_castps_si128(_mm_loadu_ps(src));
  const __m128i high = _mm_srli_epi32(bits, 16);
  const __m128i odd = _mm_and_si128(high, _mm_set1_epi32(1));
  const __m128i bias = _mm_add_epi32(odd, _mm_set1_epi32(0x7fff));
  const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, bias), 16);
  const __m128i quiet = _mm_or_si128(high, _mm_set1_epi32(0x40));
  const __m128i magnitude = _mm_and_si128(bits, _mm_set1_epi32(0x7fffffff));
  const __m128i nan = _mm_cmpgt_epi32(magnitude, _mm_set1_epi32(0x7f800000));
  const __m128i halves = _mm_blendv_epi8(rounded, quiet, nan);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi32(halves, halves));
}

// out[m][r] = x[m] . w[r] for M activation rows against R consecutive weight rows (R <= 4)
// of `in` elements. Each weight chunk is loaded once and feeds M rows, and the M x R sums
// are independent chains, so the dot products overlap instead of waiting on each other
// (1.6-1.9x the former one-weight-row kernel's products per second, weights in L2).
// `ahead`: where to ask for lines into L2 (common.h's prefetch_plan()), one per line
// this block reads, spread over the loop so the requests do not queue up in one burst;
// null for none.
template <int M, int R>
KVSERVE_BF16_TARGET inline void dot_block(const uint16_t* x, const uint16_t* w, int64_t in,
                                          const char* ahead, float out[][4]) {
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  __m512bh wk[R];
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    for (int r = 0; r < R; ++r) {
      if (ahead != nullptr) _mm_prefetch(ahead + 2 * (r * in + k), _MM_HINT_T1);
      wk[r] = (__m512bh)_mm512_loadu_si512(w + r * in + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xk = (__m512bh)_mm512_loadu_si512(x + m * in + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xk, wk[r]);
    }
  }
  if (k < in) {  // a masked tail: the zeros past it add nothing
    const __mmask32 keep = (__mmask32(1) << (in - k)) - 1;
    for (int r = 0; r < R; ++r) wk[r] = (__m512bh)_mm512_maskz_loadu_epi16(keep, w + r * in + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xk = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + m * in + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xk, wk[r]);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm_storeu_ps(out[m], lane_sums4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
  }
}

template <int R>
KVSERVE_BF16_TARGET inline void dot_rows(int64_t rows, const uint16_t* x, const uint16_t* w,
                                         int64_t in, const char* ahead, float out[][4]) {
  switch (rows) {
    case 4: dot_block<4, R>(x, w, in, ahead, out); break;
    case 3: dot_block<3, R>(x, w, in, ahead, out); break;
    case 2: dot_block<2, R>(x, w, in, ahead, out); break;
    default: dot_block<1, R>(x, w, in, ahead, out); break;
  }
}

// Output blocks [begin, end) of four weight rows (the last may be short), every activation
// row against each block while it is in L1, four rows at a time.
KVSERVE_BF16_TARGET void bf16_linear_blocks(uint16_t* op, const uint16_t* xp, const uint16_t* wp,
                                            int64_t rows, int64_t in, int64_t outs,
                                            int64_t begin, int64_t end) {
  const PrefetchPlan& plan = prefetch_plan();
  const char* stop = reinterpret_cast<const char*>(wp + std::min(end * 4, outs) * in);
  float out[4][4];
  for (int64_t block = begin; block < end; ++block) {
    const int64_t n = block * 4;
    const int64_t width = std::min<int64_t>(4, outs - n);
    const uint16_t* w = wp + n * in;
    const char* ahead = reinterpret_cast<const char*>(w) + plan.bf16_distance;
    if (ahead + width * in * 2 > stop) ahead = nullptr;
    for (int64_t m = 0; m < rows; m += 4) {
      const int64_t take = std::min<int64_t>(4, rows - m);
      const char* once = m == 0 ? ahead : nullptr;  // later rows find the lines in L1
      switch (width) {
        case 4: dot_rows<4>(take, xp + m * in, w, in, once, out); break;
        case 3: dot_rows<3>(take, xp + m * in, w, in, once, out); break;
        case 2: dot_rows<2>(take, xp + m * in, w, in, once, out); break;
        default: dot_rows<1>(take, xp + m * in, w, in, once, out); break;
      }
      for (int64_t r = 0; r < take; ++r) {
        uint16_t* row = op + (m + r) * outs + n;
        if (width == 4) {
          store_bf16x4(row, out[r]);
        } else {
          for (int64_t j = 0; j < width; ++j) row[j] = to_bf16(out[r][j]);
        }
      }
    }
  }
}

void bf16_linear_rows(uint16_t* op, const uint16_t* xp, const uint16_t* wp, int64_t rows,
                      int64_t in, int64_t outs) {
  // Each thread takes a contiguous range of blocks: one stream through the weights apiece.
  at::parallel_for(0, (outs + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    bf16_linear_blocks(op, xp, wp, rows, in, outs, begin, end);
  });
}

}  // namespace
#endif

// out[m, n] = x[m] . weight[n] for bf16 x [rows, in] and bf16 weights [out, in].
void bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(bf16_linear_supported(),
              "bf16_linear needs a CPU with AVX512_BF16 (and KVSERVE_CPU_ISA not avx2)");
  check_bf16_linear(out, x, weight, "bf16_linear");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
#ifdef KVSERVE_HAVE_BF16_KERNEL
  bf16_linear_rows(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                   reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), rows, in,
                   outs);
#endif
}

}  // namespace kvserve
