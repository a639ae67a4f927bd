// Fused CPU kernels for the decoder's hot path, registered as torch.ops.kvserve.*.
//
// Why they exist: on a small model every layer is a handful of tiny tensors, so eager
// PyTorch spends most of a decode step dispatching ~60 ops per layer, and paged decode
// attention in torch must first gather every request's blocks into a padded copy (a full
// extra write and read of the context's K/V per layer). These kernels do each job in one
// pass: RMSNorm (with the residual add fused in), rotary embedding in place on the QKV
// rows, SiLU-and-multiply, the KV-cache write by slot, and decode attention that reads K/V
// straight out of the block table.
//
// Numerics follow engine/model/llama.py's torch path: accumulation in float32, results
// rounded to the tensor dtype at the same points. Layouts are the ones documented in
// engine/model/kv_cache.py: one layer's cache is [kv_heads, num_blocks, block_size,
// head_dim], contiguous.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Rows per parallel task for row-wise kernels: small enough to split a decode batch,
// large enough that a one-row call runs inline.
constexpr int64_t kRowGrain = 4;

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

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
  const int64_t half = head_dim / 2;
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
          scalar_t* x = base + t * width + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]);
            const float x2 = static_cast<float>(x[i + half]);
            x[i] = static_cast<scalar_t>(x1 * static_cast<float>(c[i]) - x2 * static_cast<float>(s[i]));
            x[i + half] = static_cast<scalar_t>(
                x2 * static_cast<float>(c[i + half]) + x1 * static_cast<float>(s[i + half]));
          }
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
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * n;
        const scalar_t* up = gate + n;
        scalar_t* o = op + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const float g = static_cast<float>(gate[i]);
          const scalar_t activated = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
          o[i] = static_cast<scalar_t>(static_cast<float>(activated) * static_cast<float>(up[i]));
        }
      }
    });
  });
}

// Copy every token's key and value heads from its QKV row into its flat cache slot.
// key_cache / value_cache: one layer, [kv_heads, num_blocks, block_size, head_dim].
void write_kv(
    at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& qkv,
    const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(qkv, "qkv");
  TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type(), "cache and qkv dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots must be int64");
  const int64_t tokens = qkv.size(0);
  const int64_t width = qkv.size(1);
  const int64_t slots_per_head = key_cache.size(1) * key_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "write_kv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_per_head, "slot out of range");
      const scalar_t* k = src + t * width + num_heads * head_dim;
      const scalar_t* v = k + num_kv_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = (h * slots_per_head + slot[t]) * head_dim;
        std::copy(k + h * head_dim, k + (h + 1) * head_dim, kc + dst);
        std::copy(v + h * head_dim, v + (h + 1) * head_dim, vc + dst);
      }
    }
  });
}

// One (request, KV head) pair of decode attention: the `group` query heads that share the
// KV head attend to the first `context` cached tokens, read block by block.
template <typename scalar_t>
void attend_one(
    float* out, const scalar_t* query, const scalar_t* kc, const scalar_t* vc,
    const int64_t* blocks, int64_t context, int64_t group, int64_t head_dim,
    int64_t block_size, int64_t head_stride, float scale, std::vector<float>& scores) {
  scores.resize(group * context);
  std::vector<float> q(group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]) * scale;
  for (int64_t t = 0; t < context; ++t) {
    const scalar_t* k = kc + head_stride + (blocks[t / block_size] * block_size + t % block_size) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q.data() + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
      scores[g * context + t] = dot;
    }
  }
  std::fill(out, out + group * head_dim, 0.f);
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * context;
    const float peak = *std::max_element(row, row + context);
    float sum = 0.f;
    for (int64_t t = 0; t < context; ++t) {
      row[t] = std::exp(row[t] - peak);
      sum += row[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < context; ++t) {
    const scalar_t* v = vc + head_stride + (blocks[t / block_size] * block_size + t % block_size) * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * context + t];
      float* o = out + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] *= inv_sum[g];
  }
}

// Decode attention straight from the paged cache. Rows [0, batch) of qkv are single-token
// decodes; request b attends to context_lens[b] tokens listed by block_tables[b].
// Writes out[b, heads * head_dim].
void paged_decode_attention(
    at::Tensor& out, const at::Tensor& qkv, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double scale) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(block_tables, "block_tables");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong, "block_tables must be int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong, "context_lens must be int64");
  TORCH_CHECK(key_cache.scalar_type() == qkv.scalar_type(), "cache and qkv dtypes differ");
  const int64_t batch = block_tables.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t width = qkv.size(1);
  const int64_t head_stride = num_blocks * block_size * head_dim;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * block_size, "context length out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "paged_decode", [&] {
    const scalar_t* q = qkv.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<float> acc(group * head_dim);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / num_kv_heads;
        const int64_t h = task % num_kv_heads;
        const int64_t* blocks = tables + b * max_blocks;
        for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
          TORCH_CHECK(blocks[i] >= 0 && blocks[i] < num_blocks, "block id out of range");
        }
        attend_one(
            acc.data(), q + b * width + h * group * head_dim, kc, vc, blocks, lens[b], group,
            head_dim, block_size, h * head_stride, static_cast<float>(scale), scores);
        scalar_t* o = op + b * num_heads * head_dim + h * group * head_dim;
        for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<scalar_t>(acc[i]);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_rotated_heads, "
      "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor qkv, Tensor slots, "
      "int num_heads, int num_kv_heads, int head_dim) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor qkv, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, float scale) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
