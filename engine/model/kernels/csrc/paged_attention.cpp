// The paged KV cache on the CPU: the write of each token's K/V into its slot, and decode
// attention that reads K/V straight out of the block table (no gathered copy), one
// (request, KV head) pair per task, the key and value rows loaded once for every query head
// of the group. A sliding window shortens the range a request attends to (the blocks
// before it are never touched), a soft cap maps the scores before their softmax, and sinks
// join the denominator when the partitions are merged. A bf16 model on a bf16 cache takes
// bf16 dot products for both products where the CPU has them (decode_attention_bf16.h).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "decode_attention_bf16.h"
#include "ops.h"

namespace kvserve {

#ifdef KVSERVE_AVX2
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

// Whole-partition loops: a partition's token rows are gathered into a pointer list first,
// so the value accumulators of its query heads stay in registers across all of its tokens
// (the per-token loops above load and store them for every token), and key scores are
// reduced four tokens at a time instead of one horizontal sum per token. Written once over
// a vector width: Zmm (16 floats) on AVX-512 builds, Ymm (8) with AVX2. NC is head_dim /
// lanes; G the query heads one call covers.
#ifdef KVSERVE_AVX2
struct Ymm {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  template <typename cache_t>
  static V load(const cache_t* p) {
    return load8(p);
  }
  static float sum(V v) { return hsum8(v); }
  // The lane sums of a, b, c and d, in that order.
  static __m128 sum4(V a, V b, V c, V d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
};
#endif

#ifdef __AVX512F__
struct Zmm {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  template <typename cache_t>
  static V load(const cache_t* p) {
    return load16(p);
  }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static __m128 sum4(V a, V b, V c, V d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // Per 128-bit lane: [a, b, c, d] partial sums.
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 halves =
        _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 total =
        _mm512_add_ps(halves, _mm512_shuffle_f32x4(halves, halves, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(total);
  }
};
#endif

// The whole-partition loops ask for the rows this many tokens ahead while they compute
// the current ones: a partition's rows are scattered over blocks of the pool, so the
// hardware prefetcher restarts at every block, and asking for a whole partition up front
// stalls on the line-fill buffers before any arithmetic starts.
constexpr int64_t kRowsAhead = 32;

#ifdef KVSERVE_AVX2
// Asks for `bytes` from column `offset` of each of rows[from, min(to, n)).
template <typename cache_t>
inline void prefetch_rows(const cache_t* const* rows, int64_t from, int64_t to, int64_t n,
                          int64_t offset, int64_t bytes) {
  for (int64_t t = from; t < std::min(to, n); ++t) prefetch_lines(rows[t] + offset, bytes);
}

// scores[g * stride + t] = q[g] . rows[t] for t < n: four tokens at a time, each vector of
// the G query heads loaded once for the four keys (the query stays in registers while keys
// stream: about half a load per FMA), then one sum4 per query head. Every score sums its
// chunks in the same order whatever G is, so the split over heads never changes a result.
template <typename W, int G, int NC, typename cache_t>
void partition_scores(const float* q, const cache_t* const* rows, int64_t n, float* scores,
                      int64_t stride) {
  using V = typename W::V;
  constexpr int64_t kDim = W::kLanes * NC;
  constexpr int64_t kRowBytes = kDim * sizeof(cache_t);
  prefetch_rows(rows, 0, kRowsAhead, n, 0, kRowBytes);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    prefetch_rows(rows, t + kRowsAhead, t + kRowsAhead + 4, n, 0, kRowBytes);
    V acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = W::zero();
    for (int c = 0; c < NC; ++c) {
      V query[G];
      for (int g = 0; g < G; ++g) query[g] = W::loadu(q + g * kDim + W::kLanes * c);
      for (int j = 0; j < 4; ++j) {
        const V k = W::load(rows[t + j] + W::kLanes * c);
        for (int g = 0; g < G; ++g) acc[g][j] = W::fmadd(query[g], k, acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm_storeu_ps(scores + g * stride + t, W::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
  }
  for (; t < n; ++t) {
    V acc[G];
    for (int g = 0; g < G; ++g) acc[g] = W::zero();
    for (int c = 0; c < NC; ++c) {
      const V k = W::load(rows[t] + W::kLanes * c);
      for (int g = 0; g < G; ++g) acc[g] = W::fmadd(W::loadu(q + g * kDim + W::kLanes * c), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * stride + t] = W::sum(acc[g]);
  }
}

// out[g][column, column + NC lanes) = sum_t p[g * stride + t] * rows[t][same columns] for
// t < n, the G x NC accumulators in registers. A slice of the columns per call lets every
// query head of a group share each value load where the whole row's accumulators would
// not fit the registers (AVX2 at head_dim 64); each output is the same sum either way.
template <typename W, int G, int NC, typename cache_t>
void partition_values(float* out, const float* p, int64_t stride, const cache_t* const* rows,
                      int64_t n, int64_t head_dim, int64_t column) {
  using V = typename W::V;
  V acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = W::zero();
  constexpr int64_t kSliceBytes = W::kLanes * NC * sizeof(cache_t);
  prefetch_rows(rows, 0, kRowsAhead, n, column, kSliceBytes);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows(rows, t + kRowsAhead, t + kRowsAhead + 1, n, column, kSliceBytes);
    V weight[G];
    for (int g = 0; g < G; ++g) weight[g] = W::set1(p[g * stride + t]);
    for (int c = 0; c < NC; ++c) {
      const V v = W::load(rows[t] + column + W::kLanes * c);
      for (int g = 0; g < G; ++g) acc[g][c] = W::fmadd(weight[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) W::storeu(out + g * head_dim + column + W::kLanes * c, acc[g][c]);
}
#endif

// The whole-partition kernels for one (group, head_dim): scores cover the group in subsets
// of `score_heads` query heads, values in subsets of `value_heads` over slices of
// `value_columns` columns. Empty (scores == nullptr) where there are none: a build without
// AVX2, or a head_dim that is not 2, 4 or 8 vectors (AVX-512: 32, 64 or 128; AVX2, and
// AVX-512 builds under KVSERVE_CPU_ISA=avx2: 16, 32 or 64).
template <typename cache_t>
struct PartitionKernels {
  void (*scores)(const float*, const cache_t* const*, int64_t, float*, int64_t) = nullptr;
  void (*values)(float*, const float*, int64_t, const cache_t* const*, int64_t, int64_t,
                 int64_t) = nullptr;
  int64_t score_heads = 0;
  int64_t value_heads = 0;
  int64_t value_columns = 0;
  // A bf16 model on a bf16 cache, on a CPU with AVX512_BF16 (decode_attention_bf16.h),
  // taken before the above: bf16 queries in, the scale applied to the sums; `bf16_heads`
  // query heads a call, values in slices of `bf16_value_columns`.
  void (*bf16_scores)(const uint16_t*, const uint16_t* const*, int64_t, float*, int64_t,
                      float) = nullptr;
  void (*bf16_values)(float*, const uint16_t*, int64_t, const uint16_t* const*, int64_t,
                      int64_t, int64_t, const uint16_t*) = nullptr;
  int64_t bf16_heads = 0;
  int64_t bf16_value_columns = 0;
};

#ifdef KVSERVE_AVX2
// The most query heads, up to kMax (and six: the kernels instantiated), that divide the
// group evenly.
template <int kMax>
int64_t heads_per_call(int64_t group) {
  int64_t heads = std::min<int64_t>({group, kMax, 6});
  while (heads > 0 && group % heads != 0) --heads;
  return heads;
}

// pick(std::integral_constant<int, heads>) for a run-time 1 <= heads <= G.
template <int G, typename F>
void with_heads(int64_t heads, F&& pick) {
  if constexpr (G >= 1) {
    if (heads == G) {
      pick(std::integral_constant<int, G>{});
    } else {
      with_heads<G - 1>(heads, pick);
    }
  }
}

// Scores hold 4 tokens' accumulators per head, plus one register per head for the query
// and one for the key: on AVX2 three heads at a time, on AVX-512 six.
template <typename W, typename cache_t, int NC>
void pick_scores(PartitionKernels<cache_t>& k, int64_t group) {
  constexpr int kMax = (W::kRegisters - 1) / 5;
  const int64_t heads = heads_per_call<kMax>(group);
  with_heads<kMax>(heads, [&](auto g) {
    k.scores = &partition_scores<W, decltype(g)::value, NC, cache_t>;
    k.score_heads = g;
  });
}

// The widest column slice (vectors, halving from a whole row) whose G x slice accumulators,
// G weights and the value row fit the registers.
template <typename W, int G, int NC>
constexpr int value_slice() {
  int slice = NC;
  while (slice > 1 && G * slice + G + 1 > W::kRegisters) slice /= 2;
  return slice;
}

// Values: every head of the group per call (each value row read once per slice, so once in
// all), over the widest slice that fits; a group past six in equal subsets.
template <typename W, typename cache_t, int NC>
void pick_values(PartitionKernels<cache_t>& k, int64_t group) {
  with_heads<6>(heads_per_call<6>(group), [&](auto g) {
    constexpr int G = decltype(g)::value;
    constexpr int kSlice = value_slice<W, G, NC>();
    k.values = &partition_values<W, G, kSlice, cache_t>;
    k.value_heads = G;
    k.value_columns = kSlice * W::kLanes;
  });
}

template <typename W, typename cache_t>
void pick_partition_width(PartitionKernels<cache_t>& k, int64_t group, int64_t head_dim) {
  if (head_dim % W::kLanes != 0) return;  // the per-token loops
  switch (head_dim / W::kLanes) {
    case 2: pick_scores<W, cache_t, 2>(k, group); pick_values<W, cache_t, 2>(k, group); break;
    case 4: pick_scores<W, cache_t, 4>(k, group); pick_values<W, cache_t, 4>(k, group); break;
    case 8: pick_scores<W, cache_t, 8>(k, group); pick_values<W, cache_t, 8>(k, group); break;
    default: break;  // the per-token loops
  }
}
#endif

#if defined(KVSERVE_AVX2) && defined(KVSERVE_HAVE_BF16_KERNEL)
// The widest value slice (32-column chunks, halving from a whole row) whose G x slice x 2
// accumulators, G weight pairs and four row registers fit the 32 registers.
template <int G, int NC>
constexpr int bf16_value_slice() {
  int slice = NC;
  while (slice > 1 && 2 * G * slice + G + 4 > 32) slice /= 2;
  return slice;
}

template <int NC>
void pick_bf16_width(PartitionKernels<at::BFloat16>& k, int64_t group) {
  with_heads<6>(heads_per_call<6>(group), [&](auto g) {
    constexpr int G = decltype(g)::value;
    constexpr int kSlice = bf16_value_slice<G, NC>();
    k.bf16_scores = &bf16_attention::scores<G, NC>;
    k.bf16_values = &bf16_attention::values<G, kSlice>;
    k.bf16_heads = G;
    k.bf16_value_columns = 32 * kSlice;
  });
}

// The bf16 products where they run: AVX512_BF16, head_dim 32, 64 or 128.
inline void pick_bf16_partition(PartitionKernels<at::BFloat16>& k, int64_t group,
                                int64_t head_dim) {
  if (!bf16_linear_supported()) return;
  switch (head_dim) {
    case 32: pick_bf16_width<1>(k, group); break;
    case 64: pick_bf16_width<2>(k, group); break;
    case 128: pick_bf16_width<4>(k, group); break;
    default: break;
  }
}
#endif

template <typename cache_t>
PartitionKernels<cache_t> partition_kernels(int64_t group, int64_t head_dim) {
  PartitionKernels<cache_t> k;
#if defined(KVSERVE_AVX2) && defined(KVSERVE_HAVE_BF16_KERNEL)
  if constexpr (std::is_same_v<cache_t, at::BFloat16>) pick_bf16_partition(k, group, head_dim);
#endif
#ifdef __AVX512F__
  if (avx512_kernels_allowed()) {
    pick_partition_width<Zmm>(k, group, head_dim);
    return k;
  }
#endif
#ifdef KVSERVE_AVX2
  pick_partition_width<Ymm>(k, group, head_dim);
#else
  (void)group;
  (void)head_dim;
#endif
  return k;
}

// dst[d] = src[d] in the cache's type, rounded as torch's casts round (a float32 model's
// bf16 cache: eight lanes at a time where both types have vectors).
template <typename cache_t, typename scalar_t>
inline void convert_row(cache_t* dst, const scalar_t* src, int64_t n) {
  int64_t d = 0;
#ifdef KVSERVE_AVX2
  if constexpr (kHasVector8<cache_t> && kHasVector8<scalar_t>) {
    for (; d + 8 <= n; d += 8) store8(dst + d, load8(src + d));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<cache_t>(static_cast<float>(src[d]));
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
  TORCH_CHECK(key_cache.scalar_type() != at::kChar,
              "write_kv stores unquantized caches only (int8 caches are written by the torch "
              "backend, which computes their scales)");
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
      // A prefill chunk's rows land in distinct slots, so its tokens split over threads; a
      // decode step's few rows stay on one (256: the split costs more than their copy).
      at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const scalar_t* k = src + t * width + num_heads * head_dim;
          const scalar_t* v = k + num_kv_heads * head_dim;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t dst = (h * slots_per_head + slot[t]) * head_dim;
            if constexpr (std::is_same_v<scalar_t, cache_t>) {
              std::memcpy(kc + dst, k + h * head_dim, head_dim * sizeof(cache_t));
              std::memcpy(vc + dst, v + h * head_dim, head_dim * sizeof(cache_t));
            } else {
              convert_row(kc + dst, k + h * head_dim, head_dim);
              convert_row(vc + dst, v + h * head_dim, head_dim);
            }
          }
        }
      });
    });
  });
}

// Ask for a block's cache lines before they are needed: blocks are scattered through the
// pool, so the hardware prefetcher restarts at every block boundary.
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

// Calls fn(row, t, slot) for tokens [begin, end) of one KV head's slab, in order: row
// points at token t's head_dim values, slot is its index within the slab (for per-token
// scales). Walks block by block, asking for the next block's lines before they are needed.
template <typename cache_t, typename F>
inline void for_each_cached_token(const cache_t* head, const int64_t* blocks, int64_t begin,
                                  int64_t end, int64_t block_size, int64_t head_dim, F&& fn) {
  const int64_t block_elems = block_size * head_dim;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(cache_t));
  const int64_t last = (end + block_size - 1) / block_size;
  for (int64_t i = begin / block_size; i < last; ++i) {
    if (i + 1 < last) prefetch_block(head + blocks[i + 1] * block_elems, block_bytes);
    const cache_t* block = head + blocks[i] * block_elems;
    const int64_t first = i * block_size;
    for (int64_t t = std::max(begin, first); t < std::min(end, first + block_size); ++t) {
      fn(block + (t - first) * head_dim, t, blocks[i] * block_size + (t - first));
    }
  }
}

// Asks for every key row, then every value row, of a partition into L2 before its first
// product: its blocks are scattered through the pool, where the hardware prefetcher sees no
// stream, and rows asked for a few at a time ahead of the products left a 32-sequence
// step's attention at 7-10 GB/s. EPYC Zen 4, 32 x 400 tokens, cache cold, per layer: bf16
// 950 -> 575 us, float32 1390 -> 1070, int8 1130 -> 910.
template <typename cache_t>
inline void prefetch_partition(const cache_t* const* keys, const cache_t* const* values,
                               int64_t tokens, int64_t head_dim) {
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = 0; t < tokens; ++t) prefetch_lines_l2_kept(keys[t], row_bytes);
  for (int64_t t = 0; t < tokens; ++t) prefetch_lines_l2_kept(values[t], row_bytes);
}

// Multiplies one token's entry in every query head's row of a [group, tokens] matrix.
inline void scale_column(float* column, int64_t tokens, int64_t group, float factor) {
  for (int64_t g = 0; g < group; ++g) column[g * tokens] *= factor;
}

// A request's context is attended in partitions of this many tokens, each its own task,
// and the partitions' results are merged by their softmax statistics (flash-decoding).
// The split depends on the context length only, never on the batch, so a row computes
// the same numbers whatever it is batched with; and one long conversation spreads over
// every thread instead of one thread per KV head.
constexpr int64_t kPartitionTokens = 128;

// Scratch space one thread reuses across its tasks.
struct AttendScratch {
  std::vector<float> query;   // [group, head_dim], pre-scaled
  std::vector<float> scores;  // [group, tokens]
  std::vector<uint16_t> weights_bf16;  // [group, tokens rounded to even]: bf16 products
};

// One partition's result for the `group` query heads: out = sum_t exp(s_t - peak) v_t
// (unnormalised), and the peak and sum of exp(s_t - peak) it was taken against.
struct PartialView {
  float* out;   // [group, head_dim]
  float* peak;  // [group]
  float* sum;   // [group]
};

// The [group, tokens] scores capped (softcap > 0), then each query head's row turned into
// exp(s - peak) in place, its peak and the sum of the row recorded in `result`.
inline void exponentiate_scores(float* scores, int64_t group, int64_t tokens, float softcap,
                                const PartialView& result) {
  if (softcap > 0.f) soft_cap(scores, group * tokens, softcap);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * tokens;
    result.peak[g] = max_of(row, tokens);
    result.sum[g] = exp_shifted_sum(row, tokens, result.peak[g]);
  }
}

// keys[t] / values[t] pointed at the rows of token begin + t in one KV head's slabs, and
// slots[t] set to its slot (where slots is not null), for t < end - begin.
template <typename cache_t>
inline void list_partition_rows(const cache_t* k_head, const cache_t* v_head,
                                const int64_t* blocks, int64_t begin, int64_t end,
                                int64_t block_size, int64_t head_dim, const cache_t** keys,
                                const cache_t** values, int64_t* slots) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
    keys[t - begin] = k_head + slot * head_dim;
    values[t - begin] = v_head + slot * head_dim;
    if (slots != nullptr) slots[t - begin] = slot;
  }
}

// attend_range on the whole-partition kernels: the partition's key and value rows listed
// once, scores for every query head, softmax statistics, then the weighted values (the
// kernels ask for their rows a little ahead as they go).
template <typename cache_t>
void attend_partition(const float* q, const cache_t* k_head, const cache_t* v_head,
                      const float* k_scales, const float* v_scales, const int64_t* blocks,
                      int64_t begin, int64_t end, int64_t group, int64_t head_dim,
                      int64_t block_size, float softcap, const PartitionKernels<cache_t>& whole,
                      float* scores, const PartialView& result) {
  const int64_t tokens = end - begin;
  const cache_t* keys[kPartitionTokens];
  const cache_t* values[kPartitionTokens];
  int64_t slots[kPartitionTokens];
  list_partition_rows(k_head, v_head, blocks, begin, end, block_size, head_dim, keys, values,
                      slots);
  prefetch_partition(keys, values, tokens, head_dim);
  for (int64_t g = 0; g < group; g += whole.score_heads) {
    whole.scores(q + g * head_dim, keys, tokens, scores + g * tokens, tokens);
  }
  for (int64_t t = 0; k_scales != nullptr && t < tokens; ++t) {
    scale_column(scores + t, tokens, group, k_scales[slots[t]]);
  }
  exponentiate_scores(scores, group, tokens, softcap, result);
  for (int64_t t = 0; v_scales != nullptr && t < tokens; ++t) {
    scale_column(scores + t, tokens, group, v_scales[slots[t]]);
  }
  for (int64_t g = 0; g < group; g += whole.value_heads) {
    for (int64_t column = 0; column < head_dim; column += whole.value_columns) {
      whole.values(result.out + g * head_dim, scores + g * tokens, tokens, values, tokens,
                   head_dim, column);
    }
  }
}

#if defined(KVSERVE_AVX2) && defined(KVSERVE_HAVE_BF16_KERNEL)
// attend_partition on the bf16 products (decode_attention_bf16.h): q is the group's
// unscaled bf16 query rows; the softmax weights are rounded to bf16 for the values.
inline void attend_partition_bf16(const uint16_t* q, const uint16_t* k_head,
                                  const uint16_t* v_head, const int64_t* blocks, int64_t begin,
                                  int64_t end, int64_t group, int64_t head_dim,
                                  int64_t block_size, float scale, float softcap,
                                  const PartitionKernels<at::BFloat16>& whole,
                                  AttendScratch& scratch, const PartialView& result) {
  alignas(64) static const uint16_t kZeroRow[512] = {};  // head_dim <= 512
  const int64_t tokens = end - begin;
  const uint16_t* keys[kPartitionTokens];
  const uint16_t* values[kPartitionTokens];
  list_partition_rows(k_head, v_head, blocks, begin, end, block_size, head_dim, keys, values,
                      nullptr);
  prefetch_partition(keys, values, tokens, head_dim);
  float* scores = scratch.scores.data();
  for (int64_t g = 0; g < group; g += whole.bf16_heads) {
    whole.bf16_scores(q + g * head_dim, keys, tokens, scores + g * tokens, tokens, scale);
  }
  exponentiate_scores(scores, group, tokens, softcap, result);
  const int64_t padded = tokens + tokens % 2;
  scratch.weights_bf16.resize(group * padded);
  uint16_t* weights = scratch.weights_bf16.data();
  bf16_attention::round_weights(scores, tokens, group, padded, weights);
  for (int64_t g = 0; g < group; g += whole.bf16_heads) {
    for (int64_t column = 0; column < head_dim; column += whole.bf16_value_columns) {
      whole.bf16_values(result.out + g * head_dim, weights + g * padded, padded, values, tokens,
                        head_dim, column, kZeroRow);
    }
  }
}
#endif

// Tokens [begin, end) of one (request, KV head) pair: the `group` query heads that share
// the KV head attend to them, read block by block. k_head/v_head point at this KV head's
// [num_blocks, block_size, head_dim] slab. For an int8 cache, k_scales/v_scales point at
// this head's [num_blocks, block_size] float32 scales (one per token): the key scale
// multiplies the token's scores, the value scale its softmax weights, so the int8 rows
// are only ever widened, never dequantized. softcap > 0 caps the scaled scores.
template <typename scalar_t, typename cache_t>
void attend_range(
    const scalar_t* query, const cache_t* k_head, const cache_t* v_head, const float* k_scales,
    const float* v_scales, const int64_t* blocks, int64_t begin, int64_t end, int64_t group,
    int64_t head_dim, int64_t block_size, float scale, float softcap,
    const GroupKernels<cache_t>& fast, const PartitionKernels<cache_t>& whole,
    AttendScratch& scratch, const PartialView& result) {
  const int64_t tokens = end - begin;
  scratch.query.resize(group * head_dim);
  scratch.scores.resize(group * tokens);
  float* q = scratch.query.data();
  float* scores = scratch.scores.data();
  float* out = result.out;
#if defined(KVSERVE_AVX2) && defined(KVSERVE_HAVE_BF16_KERNEL)
  // A bf16 model on a bf16 cache: the query rows are bf16 already (a float32 model keeps
  // its float32 products, which rounding its queries to bf16 would give up).
  if constexpr (std::is_same_v<cache_t, at::BFloat16> && std::is_same_v<scalar_t, at::BFloat16>) {
    if (whole.bf16_scores != nullptr) {
      attend_partition_bf16(reinterpret_cast<const uint16_t*>(query),
                            reinterpret_cast<const uint16_t*>(k_head),
                            reinterpret_cast<const uint16_t*>(v_head), blocks, begin, end, group,
                            head_dim, block_size, scale, softcap, whole, scratch, result);
      return;
    }
  }
#endif
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]) * scale;
  if (whole.scores != nullptr) {
    attend_partition(q, k_head, v_head, k_scales, v_scales, blocks, begin, end, group, head_dim,
                     block_size, softcap, whole, scores, result);
    return;
  }
  std::fill(out, out + group * head_dim, 0.f);

  const auto attend_key = [&](const cache_t* key, int64_t t, int64_t slot) {
    float* column = scores + (t - begin);
    if (fast.dot) {
      fast.dot(q, key, head_dim, column, tokens);
    } else {
      dot_group_any(group, q, key, head_dim, column, tokens);
    }
    if (k_scales != nullptr) scale_column(column, tokens, group, k_scales[slot]);
  };
  for_each_cached_token(k_head, blocks, begin, end, block_size, head_dim, attend_key);
  exponentiate_scores(scores, group, tokens, softcap, result);
  const auto accumulate_value = [&](const cache_t* value, int64_t t, int64_t slot) {
    float* column = scores + (t - begin);
    if (v_scales != nullptr) scale_column(column, tokens, group, v_scales[slot]);
    if (fast.axpy) {
      fast.axpy(out, column, tokens, value, head_dim);
    } else {
      axpy_group_any(group, out, column, tokens, value, head_dim);
    }
  };
  for_each_cached_token(v_head, blocks, begin, end, block_size, head_dim, accumulate_value);
}

// Merges one (request, KV head)'s partitions into its output rows: every partition's sum
// and output are rescaled to the largest peak, then the output is divided by the total.
// With sinks (the group's query heads' logits, else null) each head's sink is one more
// term of the total, and of the peak it is taken against, with no value.
template <typename scalar_t>
void merge_partitions(const float* outs, const float* peaks, const float* sums, int64_t parts,
                      int64_t group, int64_t head_dim, const float* sinks, scalar_t* dst) {
  for (int64_t g = 0; g < group; ++g) {
    float top = peaks[g];
    for (int64_t p = 1; p < parts; ++p) top = std::max(top, peaks[p * group + g]);
    if (sinks != nullptr) top = std::max(top, sinks[g]);
    float total = sinks != nullptr ? std::exp(sinks[g] - top) : 0.f;
    float merged[512];  // head_dim <= 512 (checked by the caller)
    std::fill(merged, merged + head_dim, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float weight = std::exp(peaks[p * group + g] - top);
      total += sums[p * group + g] * weight;
      const float* src = outs + (p * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) merged[d] += src[d] * weight;
    }
    const float inv_total = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) {
      dst[g * head_dim + d] = static_cast<scalar_t>(merged[d] * inv_total);
    }
  }
}

// Decode attention straight from the paged cache. Rows [0, batch) of qkv are single-token
// decodes; request b attends to context_lens[b] tokens listed by block_tables[b] (with a
// window, to the last `window` of them). Writes out[b, heads * head_dim].
void paged_decode_attention(
    at::Tensor& out, const at::Tensor& qkv, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double scale,
    const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
    int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(head_dim <= 512, "decode attention supports head_dim up to 512");
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == (key_scale.has_value() && value_scale.has_value()),
              "an int8 KV cache needs key_scale and value_scale, other caches none");
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  if (quantized) {
    check_cpu_contiguous(*key_scale, "key_scale");
    check_cpu_contiguous(*value_scale, "value_scale");
    TORCH_CHECK(key_scale->scalar_type() == at::kFloat && value_scale->scalar_type() == at::kFloat,
                "KV scales must be float32");
    TORCH_CHECK(key_scale->numel() == num_kv_heads * num_blocks * block_size &&
                    value_scale->numel() == key_scale->numel(),
                "KV scales must be [kv_heads, num_blocks, block_size]");
    k_scales = key_scale->data_ptr<float>();
    v_scales = value_scale->data_ptr<float>();
  }
  const float* sink_logits = check_attention_variants(window, softcap, sinks, num_heads);
  const int64_t scale_stride = num_blocks * block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  // The first token each request attends to: the blocks before its block may be freed
  // (placeholder ids), so they are neither checked nor read.
  std::vector<int64_t> first_token(batch);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * block_size, "context length out of range");
    first_token[b] = window_start(lens[b] - 1, window);
    const int64_t end_block = (lens[b] + block_size - 1) / block_size;
    for (int64_t i = first_token[b] / block_size; i < end_block; ++i) {
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
      const PartitionKernels<cache_t> whole = partition_kernels<cache_t>(group, head_dim);
      // Tasks are (request, KV head, partition); pair b * kv_heads + h owns the partitions
      // [first[pair], first[pair + 1]) of the partial buffers. A request's partitions start
      // at its first attended token.
      std::vector<int64_t> first(batch * num_kv_heads + 1, 0);
      for (int64_t pair = 0; pair < batch * num_kv_heads; ++pair) {
        const int64_t b = pair / num_kv_heads;
        const int64_t parts = (lens[b] - first_token[b] + kPartitionTokens - 1) / kPartitionTokens;
        first[pair + 1] = first[pair] + parts;
      }
      const int64_t tasks = first.back();
      std::vector<float> outs(tasks * group * head_dim);
      std::vector<float> peaks(tasks * group), sums(tasks * group);
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        AttendScratch scratch;
        int64_t pair = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
        for (int64_t task = begin; task < end; ++task) {
          while (first[pair + 1] <= task) ++pair;
          const int64_t b = pair / num_kv_heads;
          const int64_t h = pair % num_kv_heads;
          const int64_t token_begin = first_token[b] + (task - first[pair]) * kPartitionTokens;
          const int64_t token_end = std::min(lens[b], token_begin + kPartitionTokens);
          const PartialView result{outs.data() + task * group * head_dim,
                                   peaks.data() + task * group, sums.data() + task * group};
          attend_range(
              q + b * width + h * group * head_dim, kc + h * head_stride, vc + h * head_stride,
              quantized ? k_scales + h * scale_stride : nullptr,
              quantized ? v_scales + h * scale_stride : nullptr, tables + b * max_blocks,
              token_begin, token_end, group, head_dim, block_size, static_cast<float>(scale),
              static_cast<float>(softcap), fast, whole, scratch, result);
        }
      });
      at::parallel_for(0, batch * num_kv_heads, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t b = pair / num_kv_heads;
          const int64_t h = pair % num_kv_heads;
          const int64_t at = first[pair];
          merge_partitions(outs.data() + at * group * head_dim, peaks.data() + at * group,
                           sums.data() + at * group, first[pair + 1] - at, group, head_dim,
                           sink_logits != nullptr ? sink_logits + h * group : nullptr,
                           op + b * num_heads * head_dim + h * group * head_dim);
        }
      });
    });
  });
}

}  // namespace kvserve
