// Few-row float32 linear on CPUs with AVX2 and FMA: float32 activations against float32
// weights, float32 out. An MoE decode step hands each expert a few rows (32 sequences over
// 32 experts, top-4: ~4 rows each), where ATen's GEMM spends more than the weights'
// streaming time on its packing and blocking; here each weight row is read once for every
// activation row, as the bf16 and int8 few-row kernels do.
//
// Batch invariant: every output is one row's dot product with one weight row, summed in
// the same order (one 8-lane accumulator over 8-element steps, then across the lanes)
// whatever the number of rows or threads, so a row gets bit-identical results alone and
// in a batch.
//
// Compiled for AVX2 + FMA whatever the build machine (a target attribute), and only called
// where the CPU has both: f32_linear_supported() reads the CPU's features at run time.

#include <algorithm>

#include "common.h"
#include "ops.h"
#include "projection.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_F32_TARGET __attribute__((target("avx2,fma")))
#define KVSERVE_HAVE_F32_KERNEL 1
#endif

namespace kvserve {

bool f32_linear_supported() {
#ifdef KVSERVE_HAVE_F32_KERNEL
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
#else
  return false;
#endif
}

#ifdef KVSERVE_HAVE_F32_KERNEL
namespace {

// Lanes [0, left) set, for a masked load of the last partial vector.
KVSERVE_F32_TARGET inline __m256i tail_mask(int64_t left) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lanes);
}

KVSERVE_F32_TARGET inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// out[m * N + j] = x[m] . w[j] for M activation rows (row stride ldx) against N weight
// rows (row stride ldw) of n elements: one 8-lane accumulator per (row, weight row), so
// each 8-element chunk of a weight row feeds every activation row from a register and
// each chunk of an activation row every weight row (M * N FMAs for M + N loads). Every
// output is the same chain whatever M and N: its lanes summed over k in steps of 8 (the
// tail masked: zeros add 0), then across.
template <int M, int N>
KVSERVE_F32_TARGET inline void dot_tile_f32(const float* x, int64_t ldx, const float* w,
                                            int64_t ldw, int64_t n, float* out) {
  __m256 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < N; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 wk[N];
    for (int j = 0; j < N; ++j) wk[j] = _mm256_loadu_ps(w + j * ldw + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xk = _mm256_loadu_ps(x + m * ldx + k);
      for (int j = 0; j < N; ++j) acc[m][j] = _mm256_fmadd_ps(xk, wk[j], acc[m][j]);
    }
  }
  if (k < n) {
    const __m256i keep = tail_mask(n - k);
    __m256 wk[N];
    for (int j = 0; j < N; ++j) wk[j] = _mm256_maskload_ps(w + j * ldw + k, keep);
    for (int m = 0; m < M; ++m) {
      const __m256 xk = _mm256_maskload_ps(x + m * ldx + k, keep);
      for (int j = 0; j < N; ++j) acc[m][j] = _mm256_fmadd_ps(xk, wk[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < N; ++j) out[m * N + j] = sum8(acc[m][j]);
}

// Weight rows a tile takes (12 accumulators at four activation rows).
constexpr int64_t kTileOuts = 3;

template <int N>
KVSERVE_F32_TARGET inline void dot_tile_rows(int64_t take, const float* x, int64_t ldx,
                                             const float* w, int64_t ldw, int64_t n, float* out) {
  switch (take) {
    case 4: dot_tile_f32<4, N>(x, ldx, w, ldw, n, out); break;
    case 3: dot_tile_f32<3, N>(x, ldx, w, ldw, n, out); break;
    case 2: dot_tile_f32<2, N>(x, ldx, w, ldw, n, out); break;
    default: dot_tile_f32<1, N>(x, ldx, w, ldw, n, out); break;
  }
}

// Each thread walks a contiguous range of weight rows, kTileOuts at a time, asking for
// their lines ahead (common.h's prefetch_plan(): they stream from memory, as int8's rows
// do), and runs every activation row against them, four at a time, while they are in L1.
KVSERVE_F32_TARGET void f32_linear_rows(float* op, const float* xp, const float* wp, int64_t rows,
                                        int64_t in, int64_t outs) {
  at::parallel_for(0, outs, 64, [&](int64_t begin, int64_t end) {
    float dots[4 * kTileOuts];
    const float* stop = wp + end * in;
    for (int64_t n = begin; n < end; n += kTileOuts) {
      const int64_t outs_here = std::min<int64_t>(kTileOuts, end - n);
      const float* w = wp + n * in;
      prefetch_ahead(w, outs_here * in * static_cast<int64_t>(sizeof(float)), stop);
      for (int64_t m = 0; m < rows; m += 4) {
        const int64_t take = std::min<int64_t>(4, rows - m);
        const float* x = xp + m * in;
        switch (outs_here) {
          case 3: dot_tile_rows<3>(take, x, in, w, in, in, dots); break;
          case 2: dot_tile_rows<2>(take, x, in, w, in, in, dots); break;
          default: dot_tile_rows<1>(take, x, in, w, in, in, dots); break;
        }
        for (int64_t r = 0; r < take; ++r) {
          float* o = op + (m + r) * outs + n;
          for (int64_t j = 0; j < outs_here; ++j) o[j] = dots[r * outs_here + j];
        }
      }
    }
  });
}

}  // namespace
#endif

// out[m, n] = x[m] . weight[n] for float32 x [rows, in] (rows <= kF32FewRows) and
// float32 weights [out, in].
void f32_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(f32_linear_supported(), "f32_linear needs a CPU with AVX2 and FMA");
  check_float_rows(out, x);
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "f32_linear takes float32 weights, not ",
              weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "2-D tensors expected");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
  TORCH_CHECK(rows <= kF32FewRows, "f32_linear takes at most ", kF32FewRows,
              " rows, not ", rows, " (larger batches belong to a GEMM)");
  TORCH_CHECK(weight.size(1) == in && out.size(0) == rows && out.size(1) == outs, "shape mismatch");
#ifdef KVSERVE_HAVE_F32_KERNEL
  f32_linear_rows(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), rows, in,
                  outs);
#endif
}

}  // namespace kvserve
