// Row-wise kernels: RMSNorm (plain and with the residual add fused in), rotary embedding
// in place on the QKV rows, SiLU-and-multiply. One call each where eager torch dispatches
// five to fifteen small ops per layer.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common.h"
#include "ops.h"

namespace kvserve {

template <typename scalar_t>
float sum_of_squares(const scalar_t* x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    acc += v * v;
  }
  return acc;
}

template <typename scalar_t>
void norm_row(scalar_t* out, const scalar_t* x, const scalar_t* w, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    // The reference rounds the normalised value to the dtype before scaling by the weight.
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

// out = weight * x / rms(x), row by row over the last dimension.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(out, "out");
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(op + r * n, xp + r * n, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// residual += x; x = weight * residual / rms(residual). Both in place, row by row.
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(residual, "residual");
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* res = rp + r * n;
        const scalar_t* add = xp + r * n;
        for (int64_t i = 0; i < n; ++i) {
          res[i] = static_cast<scalar_t>(static_cast<float>(res[i]) + static_cast<float>(add[i]));
        }
        norm_row(xp + r * n, res, wp, n, static_cast<float>(eps));
      }
    });
  });
}

// One head's rotate-half rotation: x[i] = x1 c[i] - x2 s[i], x[i + half] = x2 c[i + half]
// + x1 s[i + half], eight pairs at a time where the CPU has AVX2.
template <typename scalar_t>
void rotate_head(scalar_t* x, const scalar_t* c, const scalar_t* s, int64_t half) {
  int64_t i = 0;
#ifdef KVSERVE_AVX2
  if constexpr (kHasVector8<scalar_t>) {
    for (; i + 8 <= half; i += 8) {
      const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
      store8(x + i,
             _mm256_sub_ps(_mm256_mul_ps(x1, load8(c + i)), _mm256_mul_ps(x2, load8(s + i))));
      store8(x + i + half, _mm256_add_ps(_mm256_mul_ps(x2, load8(c + i + half)),
                                         _mm256_mul_ps(x1, load8(s + i + half))));
    }
  }
#endif
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]);
    const float x2 = static_cast<float>(x[i + half]);
    x[i] = static_cast<scalar_t>(x1 * static_cast<float>(c[i]) - x2 * static_cast<float>(s[i]));
    x[i + half] = static_cast<scalar_t>(
        x2 * static_cast<float>(c[i + half]) + x1 * static_cast<float>(s[i + half]));
  }
}

// Rotate-half rotary embedding, in place on the query and key heads of each QKV row
// ([tokens, (heads + 2 * kv_heads) * head_dim], queries then keys then values).
// cos/sin are [max_positions, head_dim] tables with both halves filled.
void rotary_(
    at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_rotated_heads, int64_t head_dim) {
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(cos, "cos");
  check_cpu_contiguous(sin, "sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  const int64_t tokens = qkv.size(0);
  const int64_t width = qkv.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cos_table = cos.data_ptr<scalar_t>();
    const scalar_t* sin_table = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cos_table + pos[t] * head_dim;
        const scalar_t* s = sin_table + pos[t] * head_dim;
        for (int64_t h = 0; h < num_rotated_heads; ++h) {
          rotate_head(base + t * width + h * head_dim, c, s, head_dim / 2);
        }
      }
    });
  });
}

#ifdef __AVX512F__
// 16 float32 values rounded to bf16 as torch's cast rounds (to nearest even; a NaN becomes
// 0x7fc0), kept in the high halves of the lanes.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
      _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
}
inline void store16(at::BFloat16* p, __m512 v) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// e^x for x clamped to [-87, 87]: 2^(x log2e) split as 2^n 2^f, |f| <= 1/2, 2^f by its
// Taylor polynomial to degree 5 (relative error < 3e-6, far inside a bf16 rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.3333558146428443e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// A bf16 row of silu(gate) * up, 16 at a time (other types: 0 done): the activation is
// rounded to bf16 before the multiply, as torch's silu(gate) * up rounds it. exp16 and the
// scalar loop's std::exp may differ in the last float bits, so a product can land one bf16
// step apart from it. Returns how many leading elements it wrote.
template <typename scalar_t>
int64_t silu_and_mul_16(scalar_t* o, const scalar_t* gate, const scalar_t* up, int64_t n) {
  if constexpr (!std::is_same_v<scalar_t, at::BFloat16>) {
    return 0;
  } else {
    const __m512 one = _mm512_set1_ps(1.f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 g = load16(gate + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 activated =
          _mm512_castsi512_ps(bf16_bits16(_mm512_div_ps(g, _mm512_add_ps(one, e))));
      store16(o + i, _mm512_mul_ps(activated, load16(up + i)));
    }
    return i;
  }
}
#endif

// out = silu(x[:, :n]) * x[:, n:] for x of shape [rows, 2n].
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(out, "out");
  const int64_t n = out.size(-1);
  const int64_t rows = out.numel() / n;
  TORCH_CHECK(x.size(-1) == 2 * n, "x must be twice as wide as out");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> exp_neg(n);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * n;
        const scalar_t* up = gate + n;
        scalar_t* o = op + r * n;
#ifdef __AVX512F__
        if (silu_and_mul_16(o, gate, up, n) == n) continue;  // a whole bf16 row
#endif
        for (int64_t i = 0; i < n; ++i) exp_neg[i] = -static_cast<float>(gate[i]);
        exp_shifted_sum(exp_neg.data(), n, 0.f);
        for (int64_t i = 0; i < n; ++i) {
          const float g = static_cast<float>(gate[i]);
          const scalar_t activated = static_cast<scalar_t>(g / (1.f + exp_neg[i]));
          o[i] = static_cast<scalar_t>(static_cast<float>(activated) * static_cast<float>(up[i]));
        }
      }
    });
  });
}

}  // namespace kvserve
