// Shared by the kvserve CPU kernels: AVX2 helpers (with portable fallbacks) and checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_AVX2 1
#endif

namespace kvserve {

// Whether the AVX-512 kernels (bf16 dot products, VNNI) may run where the CPU has them:
// false when KVSERVE_CPU_ISA=avx2, which keeps the AVX2 kernels on an AVX-512 machine so
// tests and benchmarks can exercise and compare both families on one CPU (cpu_features.cpp).
bool avx512_kernels_allowed();

// Whether the AMX kernels (prefill attention tiles) may run where the CPU has them: false
// whenever KVSERVE_CPU_ISA is set (avx512 keeps the AVX-512 kernels, avx2 the AVX2 ones).
bool amx_kernels_allowed();

#ifdef KVSERVE_AVX2
// exp for 8 floats: Cephes' range reduction (x = n ln2 + r) and degree-5 polynomial,
// relative error ~1e-7, inputs clamped to +-88.37 so the result never overflows to inf.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}
#endif

// The largest of x[0..n), n > 0: eight independent lanes instead of one scalar chain
// (std::max_element's 4-cycle dependency per element was a quarter of a decode partition).
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float top = x[0];
#ifdef KVSERVE_AVX2
  if (n >= 8) {
    __m256 lanes = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + i));
    alignas(32) float values[8];
    _mm256_store_ps(values, lanes);
    top = *std::max_element(values, values + 8);
  }
#endif
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// x[i] = exp(x[i] - shift) in place; returns the sum of the results.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef KVSERVE_AVX2
  __m256 acc = _mm256_setzero_ps();
  const __m256 s = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

#ifdef __AVX512F__
// 2^t for 16 floats t <= 0 (AVX-512 builds): t = n + f with |f| <= 1/2, 2^f by its Taylor
// polynomial to degree 6 (relative error ~1.2e-7, float's own), scaled by 2^n; t below
// -127 (or NaN) is taken as -127.
inline __m512 exp2_nonpositive16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^k / k!, k = 6 down to 0
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#endif

// Attention logit soft-capping (Gemma 2) in place: x[i] = limit * tanh(x[i] / limit), with
// `limit` the cap in the units x is in (cap / scale for scores the scale multiplies later).
// tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2|y|) in [0, 1]: nothing overflows for any
// score, and the absolute error stays near exp's 1e-7, which the limit scales as rounding
// the capped score to float would. The vector loops divide by 1 + e (in [1, 2]) as a
// reciprocal estimate and one Newton step: a division cost more than the rest together.
// Runs before masking: a masked -inf would become -limit.
inline void soft_cap(float* x, int64_t n, float limit) {
  const float factor = -2.f / limit;
  int64_t i = 0;
#ifdef __AVX512F__
  {
    const __m512 log2_factor = _mm512_set1_ps(factor * 1.44269504088896341f);
    const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
    const __m512 limits = _mm512_set1_ps(limit);
    const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 e = exp2_nonpositive16(_mm512_mul_ps(_mm512_abs_ps(v), log2_factor));
      const __m512 denominator = _mm512_add_ps(one, e);
      __m512 inverse = _mm512_rcp14_ps(denominator);
      inverse = _mm512_mul_ps(inverse, _mm512_fnmadd_ps(denominator, inverse, two));
      const __m512 magnitude = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(one, e), inverse), limits);
      const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), sign_bit);
      _mm512_storeu_ps(x + i, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign)));
    }
  }
#endif
#ifdef KVSERVE_AVX2
  {
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
    const __m256 limits = _mm256_set1_ps(limit), factors = _mm256_set1_ps(factor);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, v), factors));
      const __m256 denominator = _mm256_add_ps(one, e);
      __m256 inverse = _mm256_rcp_ps(denominator);
      inverse = _mm256_mul_ps(inverse, _mm256_fnmadd_ps(denominator, inverse, two));
      const __m256 magnitude = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(one, e), inverse), limits);
      _mm256_storeu_ps(x + i, _mm256_or_ps(magnitude, _mm256_and_ps(sign_bit, v)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float e = std::exp(std::fabs(x[i]) * factor);
    x[i] = std::copysign(limit * ((1.f - e) / (1.f + e)), x[i]);
  }
}

#ifdef KVSERVE_AVX2
// Eight cache values widened to float32 (an int8 cache's scale is applied by the caller).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}

// Eight floats rounded to bf16, kept in float32 lanes (the low 16 bits zero): round to
// nearest even as torch's cast does, a NaN becoming bf16's quiet NaN 0x7fc0 as in
// c10::BFloat16.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
}

// Eight floats stored as scalar_t, rounded as torch's casts round.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(bf16_bits8(v), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// The element types load8 and store8 take (the kernels' dispatch also instantiates double).
template <typename T>
inline constexpr bool kHasVector8 =
    std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

#ifdef __AVX512F__
// Sixteen cache or model values widened to float32 (AVX-512 builds).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Calls f(cache_t{}) with the C++ type of a KV cache dtype: the cache may be stored in a
// narrower type than the model computes in (e.g. a bfloat16 cache under float32 compute).
template <typename F>
void with_cache_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kChar: f(int8_t{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", dtype);
  }
}

// How far ahead of the row it is reading a few-row GEMV asks for weight lines, into L2
// (prefetcht1). Each thread streams a contiguous range of rows, and where the hardware
// prefetcher keeps too few lines in flight one core cannot reach the memory's rate on its
// own. Lines parked in L2 leave the L1 fill buffers to the loads, so more lines are in
// flight per core.
//
// Intel: 64 KiB ahead for every kernel. On the 2-vCPU Xeon-AMX VM, decode steps of the
// embedded model, alternating processes: bf16 20.8-22.0 -> 18.1-18.6 ms, int8 12.3-13.3 ->
// 10.5-12.3 ms, int4 8.4-8.9 -> 8.2-8.5 ms against the former plan (into L1, 8 KiB ahead,
// none for bf16).
// AMD: 8 KiB ahead for the int8/int4/f32 kernels (the best of 1-12 KiB at 1 and 4 rows; 32
// KiB was 0-10% slower for int8), 32 KiB for bf16. On the 2-vCPU EPYC (Zen 4) VM, a decode
// step's bf16 projections (212 MB, cold) with none -> 32 KiB ahead: 1 row 10.0 -> 7.3-7.7
// ms, 8 rows 16.2 -> 8.7 ms, 32 rows 30.2 -> 25.7 ms (16 and 64 KiB within 5%).
struct PrefetchPlan {
  int64_t distance;       // bytes ahead of the row being read: int8, int4, f32
  int64_t bf16_distance;  // the same for the bf16 kernel
};

inline const PrefetchPlan& prefetch_plan() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const PrefetchPlan plan =
      __builtin_cpu_is("intel") ? PrefetchPlan{65536, 65536} : PrefetchPlan{8192, 32768};
#else
  static const PrefetchPlan plan{8192, 32768};
#endif
  return plan;
}

// Asks for the cache lines of [start, start + bytes) into every cache level.
inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

// Asks for the cache lines of [start, start + bytes) into L2 (and L1 where the CPU does not
// tell the levels apart).
inline void prefetch_lines_l2(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 2);
}

// prefetch_lines_l2 in a form the compiler keeps: GCC 12 at -O3 deleted a loop whose body
// was only __builtin_prefetch calls over a run-time count of rows (paged_attention.cpp's
// prefetch_partition: not one prefetcht1 left in the object), and an asm statement is not
// an instruction it may drop.
inline void prefetch_lines_l2_kept(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    asm volatile("prefetcht1 %0" : : "m"(*(p + offset)));
#else
    __builtin_prefetch(p + offset, 0, 2);
#endif
  }
}

// Asks for the cache lines of [start + distance, + bytes) that lie before `stop` (the end of
// what this thread reads), into L2.
inline void prefetch_ahead(const void* start, int64_t bytes, const void* stop) {
  const char* p = static_cast<const char*>(start) + prefetch_plan().distance;
  prefetch_lines_l2(p, std::min<int64_t>(bytes, static_cast<const char*>(stop) - p));
}

// The int8 few-row GEMVs' outer loop (the float kernel, the integer kernel's AVX2 form):
// each thread walks a contiguous range of weight rows of `in` elements, and every
// activation row meets a weight row while it is in L1, up to four at a time. dots(M, first, w, out), with M a
// std::integral_constant of 1..4, sets out[0..M) to activation rows [first, first + M)
// against the weight row w; store(m, n, dot) writes one result. Each row's lines are asked
// for prefetch_plan().distance ahead.
template <typename weight_t, typename Dots, typename Store>
void for_each_weight_row(int64_t rows, int64_t outs, int64_t in, const weight_t* wp,
                         const Dots& dots, const Store& store) {
  at::parallel_for(0, outs, 64, [&](int64_t begin, int64_t end) {
    float out[4];
    const weight_t* stop = wp + end * in;
    for (int64_t n = begin; n < end; ++n) {
      const weight_t* w = wp + n * in;
      prefetch_ahead(w, in * static_cast<int64_t>(sizeof(weight_t)), stop);
      for (int64_t m = 0; m < rows; m += 4) {
        const int64_t take = std::min<int64_t>(4, rows - m);
        switch (take) {
          case 4: dots(std::integral_constant<int, 4>{}, m, w, out); break;
          case 3: dots(std::integral_constant<int, 3>{}, m, w, out); break;
          case 2: dots(std::integral_constant<int, 2>{}, m, w, out); break;
          default: dots(std::integral_constant<int, 1>{}, m, w, out); break;
        }
        for (int64_t r = 0; r < take; ++r) store(m + r, n, out[r]);
      }
    }
  });
}

// Rows per parallel task for row-wise kernels: small enough to split a decode batch,
// large enough that a one-row call runs inline.
constexpr int64_t kRowGrain = 4;

inline void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The first key a query at `position` sees under a sliding window of `window` tokens, the
// query's own included (0: no window, every earlier key).
inline int64_t window_start(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
}

// Checks the attention variants' arguments (decode and prefill): a sliding window in tokens
// and a logit soft cap (0: none), optional sink logits, one per query head. Returns the
// sinks' data, or null without them.
inline const float* check_attention_variants(int64_t window, double softcap,
                                             const std::optional<at::Tensor>& sinks,
                                             int64_t num_heads) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: no soft-capping)");
  if (!sinks.has_value()) return nullptr;
  check_cpu_contiguous(*sinks, "sinks");
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == num_heads,
              "sinks must be float32 [num_heads]");
  return sinks->data_ptr<float>();
}

// The linear kernels' activations in and results out: contiguous float32 on the CPU.
inline void check_float_rows(const at::Tensor& out, const at::Tensor& x) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "x and out must be float32");
}

// A bf16 linear's operands (bf16_linear, bf16_linear_amx): contiguous bf16 CPU tensors, x
// [rows, in], weight [out, in], out [rows, out]; `op` names the kernel in the messages.
inline void check_bf16_linear(const at::Tensor& out, const at::Tensor& x,
                              const at::Tensor& weight, const char* op) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              op, " takes bfloat16 x, weight and out");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "2-D tensors expected");
  TORCH_CHECK(weight.size(1) == x.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == weight.size(0),
              "shape mismatch");
}

}  // namespace kvserve
