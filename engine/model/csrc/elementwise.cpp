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
