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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_AVX2 1
#endif

namespace {

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

// x[i] = exp(x[i] - shift) in place; returns the sum of the results.
float exp_shifted_sum(float* x, int64_t n, float shift) {
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

#ifdef KVSERVE_AVX2
// Eight cache values widened to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// scores[g * stride] = q[g] . k for the G query heads sharing one key row: the key is
// loaded once per 8 lanes and the G dot products run as independent FMA chains.
template <int G, typename cache_t>
inline void dot_group(const float* q, const cache_t* k, int64_t head_dim, float* scores,
                      int64_t stride) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 kv = load8(k + d);
    for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + d), kv, acc[g]);
  }
  for (int g = 0; g < G; ++g) scores[g * stride] = hsum8(acc[g]);
}

// out[g] += p[g * stride] * v for the G query heads sharing one value row.
template <int G, typename cache_t>
inline void axpy_group(float* out, const float* p, int64_t stride, const cache_t* v,
                       int64_t head_dim) {
  __m256 weight[G];
  for (int g = 0; g < G; ++g) weight[g] = _mm256_set1_ps(p[g * stride]);
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 vv = load8(v + d);
    for (int g = 0; g < G; ++g) {
      float* o = out + g * head_dim + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(weight[g], vv, _mm256_loadu_ps(o)));
    }
  }
}
#endif

// Portable versions of the two inner loops, for any group size and head_dim.
template <typename cache_t>
inline void dot_group_any(int64_t group, const float* q, const cache_t* k, int64_t head_dim,
                          float* scores, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_dim;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
    scores[g * stride] = dot;
  }
}

template <typename cache_t>
inline void axpy_group_any(int64_t group, float* out, const float* p, int64_t stride,
                           const cache_t* v, int64_t head_dim) {
  for (int64_t g = 0; g < group; ++g) {
    const float weight = p[g * stride];
    float* o = out + g * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * static_cast<float>(v[d]);
  }
}

// Dispatches a group size known at compile time to the AVX2 loops (G query heads per KV
// head: 1 for MHA, 2-8 for the GQA models we serve), anything else to the portable ones.
template <typename cache_t>
struct GroupKernels {
  void (*dot)(const float*, const cache_t*, int64_t, float*, int64_t) = nullptr;
  void (*axpy)(float*, const float*, int64_t, const cache_t*, int64_t) = nullptr;
};

template <typename cache_t, int G>
void pick_group(GroupKernels<cache_t>& k) {
#ifdef KVSERVE_AVX2
  k.dot = &dot_group<G, cache_t>;
  k.axpy = &axpy_group<G, cache_t>;
#endif
}

template <typename cache_t>
GroupKernels<cache_t> group_kernels(int64_t group, int64_t head_dim) {
  GroupKernels<cache_t> k;
  if (head_dim % 8 != 0) return k;
  switch (group) {
    case 1: pick_group<cache_t, 1>(k); break;
    case 2: pick_group<cache_t, 2>(k); break;
    case 3: pick_group<cache_t, 3>(k); break;
    case 4: pick_group<cache_t, 4>(k); break;
    case 5: pick_group<cache_t, 5>(k); break;
    case 6: pick_group<cache_t, 6>(k); break;
    case 7: pick_group<cache_t, 7>(k); break;
    case 8: pick_group<cache_t, 8>(k); break;
    default: break;
  }
  return k;
}

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

// Calls f(cache_t{}) with the C++ type of a KV cache dtype: the cache may be stored in a
// narrower type than the model computes in (e.g. a bfloat16 cache under float32 compute).
template <typename F>
void with_cache_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", dtype);
  }
}

// Copy every token's key and value heads from its QKV row into its flat cache slot.
// key_cache / value_cache: one layer, [kv_heads, num_blocks, block_size, head_dim].
void write_kv(
    at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& qkv,
    const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(qkv, "qkv");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots must be int64");
  const int64_t tokens = qkv.size(0);
  const int64_t width = qkv.size(1);
  const int64_t slots_per_head = key_cache.size(1) * key_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_per_head, "slot out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "write_kv", [&] {
    with_cache_type(key_cache.scalar_type(), [&](auto tag) {
      using cache_t = decltype(tag);
      const scalar_t* src = qkv.data_ptr<scalar_t>();
      cache_t* kc = key_cache.data_ptr<cache_t>();
      cache_t* vc = value_cache.data_ptr<cache_t>();
      for (int64_t t = 0; t < tokens; ++t) {
        const scalar_t* k = src + t * width + num_heads * head_dim;
        const scalar_t* v = k + num_kv_heads * head_dim;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t dst = (h * slots_per_head + slot[t]) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) {
            kc[dst + d] = static_cast<cache_t>(static_cast<float>(k[h * head_dim + d]));
            vc[dst + d] = static_cast<cache_t>(static_cast<float>(v[h * head_dim + d]));
          }
        }
      }
    });
  });
}

// Ask for a block's cache lines before they are needed: blocks are scattered through the
// pool, so the hardware prefetcher restarts at every block boundary.
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

// Scratch space one thread reuses across its (request, KV head) tasks.
struct AttendScratch {
  std::vector<float> query;   // [group, head_dim], pre-scaled
  std::vector<float> scores;  // [group, context]
  std::vector<float> out;     // [group, head_dim]
};

// One (request, KV head) pair of decode attention: the `group` query heads that share the
// KV head attend to the first `context` cached tokens, read block by block. k_head/v_head
// point at this KV head's [num_blocks, block_size, head_dim] slab.
template <typename scalar_t, typename cache_t>
void attend_one(
    const scalar_t* query, const cache_t* k_head, const cache_t* v_head, const int64_t* blocks,
    int64_t context, int64_t group, int64_t head_dim, int64_t block_size, float scale,
    const GroupKernels<cache_t>& fast, AttendScratch& scratch) {
  const int64_t block_elems = block_size * head_dim;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(cache_t));
  const int64_t used = (context + block_size - 1) / block_size;
  scratch.query.resize(group * head_dim);
  scratch.scores.resize(group * context);
  scratch.out.assign(group * head_dim, 0.f);
  float* q = scratch.query.data();
  float* scores = scratch.scores.data();
  float* out = scratch.out.data();
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]) * scale;

  for (int64_t i = 0; i < used; ++i) {
    if (i + 1 < used) prefetch_block(k_head + blocks[i + 1] * block_elems, block_bytes);
    const cache_t* kb = k_head + blocks[i] * block_elems;
    const int64_t n = std::min(block_size, context - i * block_size);
    for (int64_t j = 0; j < n; ++j) {
      float* column = scores + i * block_size + j;
      if (fast.dot) {
        fast.dot(q, kb + j * head_dim, head_dim, column, context);
      } else {
        dot_group_any(group, q, kb + j * head_dim, head_dim, column, context);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * context;
    const float peak = *std::max_element(row, row + context);
    const float inv_sum = 1.f / exp_shifted_sum(row, context, peak);
    for (int64_t t = 0; t < context; ++t) row[t] *= inv_sum;
  }
  for (int64_t i = 0; i < used; ++i) {
    if (i + 1 < used) prefetch_block(v_head + blocks[i + 1] * block_elems, block_bytes);
    const cache_t* vb = v_head + blocks[i] * block_elems;
    const int64_t n = std::min(block_size, context - i * block_size);
    for (int64_t j = 0; j < n; ++j) {
      const float* column = scores + i * block_size + j;
      if (fast.axpy) {
        fast.axpy(out, column, context, vb + j * head_dim, head_dim);
      } else {
        axpy_group_any(group, out, column, context, vb + j * head_dim, head_dim);
      }
    }
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
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "paged_decode", [&] {
    with_cache_type(key_cache.scalar_type(), [&](auto tag) {
      using cache_t = decltype(tag);
      const scalar_t* q = qkv.data_ptr<scalar_t>();
      const cache_t* kc = key_cache.data_ptr<cache_t>();
      const cache_t* vc = value_cache.data_ptr<cache_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      const GroupKernels<cache_t> fast = group_kernels<cache_t>(group, head_dim);
      at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        AttendScratch scratch;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / num_kv_heads;
          const int64_t h = task % num_kv_heads;
          attend_one(
              q + b * width + h * group * head_dim, kc + h * head_stride, vc + h * head_stride,
              tables + b * max_blocks, lens[b], group, head_dim, block_size,
              static_cast<float>(scale), fast, scratch);
          scalar_t* o = op + b * num_heads * head_dim + h * group * head_dim;
          for (int64_t i = 0; i < group * head_dim; ++i) {
            o[i] = static_cast<scalar_t>(scratch.out[i]);
          }
        }
      });
    });
  });
}

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
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(weight, "weight");
  check_cpu_contiguous(scales, "scales");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "x and out must be float32");
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
  at::parallel_for(0, outs, 64, [&](int64_t begin, int64_t end) {
    float dots[4];
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = wp + n * in;
      for (int64_t m = 0; m < rows;) {
        const int64_t take = std::min<int64_t>(4, rows - m);
        const float* xm = xp + m * in;
        if (!vectorised) {
          for (int64_t r = 0; r < take; ++r) dots[r] = dot_f32_i8_any(xm + r * in, w, in);
        }
#ifdef KVSERVE_AVX2
        else if (take == 4) dot_rows_i8<4>(xm, in, w, in, dots);
        else if (take == 3) dot_rows_i8<3>(xm, in, w, in, dots);
        else if (take == 2) dot_rows_i8<2>(xm, in, w, in, dots);
        else dot_rows_i8<1>(xm, in, w, in, dots);
#endif
        for (int64_t r = 0; r < take; ++r) op[(m + r) * outs + n] = dots[r] * sp[n];
        m += take;
      }
    }
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
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("write_kv", &write_kv);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("int8_linear", &int8_linear);
}
