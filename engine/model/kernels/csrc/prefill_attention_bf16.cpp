// Prefill attention with bf16 tile products (vdpbf16ps: 32 bf16 products per instruction,
// float32 sums), for bf16 models on CPUs with AVX512_BF16. Same tasks, same online softmax
// as the float32 version in prefill_attention.cpp; what changes is the layout, chosen so
// that no product needs a horizontal sum and the softmax runs down vector lanes:
//
//   scores^T [keys x rows] = K . Q^T   each key's bf16 pair (k[2p], k[2p+1]) broadcast
//                                      straight from the cache against 16 query rows'
//                                      pairs (Q packed once per task, rows in lanes)
//   softmax per lane                   running max and sum of 16 rows per vector; the
//                                      attention scale is folded into the exponent
//   out^T [d x rows] += V^T . P^T      each value pair (v[2j][d], v[2j+1][d]) broadcast
//                                      against 16 rows' probability pairs (bf16)
//
// Probabilities are rounded to bf16 before the second product (as a bf16 GEMM would);
// sums, the running max/sum and the output accumulate in float32. Scores stay unscaled
// until the exponent, so a soft cap is applied in those units (cap / scale) and a sink
// enters as sink / scale. Compiled for AVX512_BF16 whatever the build machine (a target
// attribute) and called only where the CPU has it (bf16_tiles_supported), so one build
// serves AVX2-only and AVX-512 machines alike.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "ops.h"
#include "prefill_attention.h"
#include "prefill_tiles.h"

namespace kvserve::prefill {

bool bf16_tiles_supported(int64_t head_dim) {
  return bf16_linear_supported() && head_dim % 2 == 0;
}

#ifdef KVSERVE_HAVE_BF16_PREFILL
namespace {

constexpr int64_t kLanes = 16;       // float32 lanes: query rows per vector
constexpr int kKeyBlock = 6;         // keys per scores micro-kernel (x 4 row vectors)
constexpr int kRowVectors = 4;       // row vectors per scores micro-kernel: 24 accumulators
constexpr int kDimBlock = 8;         // head dims per output micro-kernel (x 3 row vectors)
constexpr int kOutputRowVectors = 3; // 24 accumulators, no padding for head_dim 64 or 128
constexpr int64_t kPaddedKeys = (kKeyTile + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
uint32_t load_pair(const uint16_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// Per-thread buffers, sized once per task (rows are padded to whole vectors, head dims to
// whole output blocks; the padding stays zero, so it adds zeros, never garbage).
struct Scratch {
  int64_t ld = 0;    // padded rows: the lane dimension of query, scores, probs, out
  int64_t dims = 0;  // padded head_dim: the row length of values and out
  std::vector<uint32_t> query;   // [head_dim / 2][ld]: each row's (q[2p], q[2p+1])
  std::vector<float> scores;     // [kPaddedKeys][ld]: scores, then probabilities
  std::vector<uint32_t> probs;   // [kKeyTile / 2][ld]: (p[2j], p[2j+1]) in bf16
  std::vector<uint32_t> values;  // [kKeyTile / 2][dims]: (v[2j][d], v[2j+1][d])
  std::vector<float> out;        // [dims][ld]
  std::vector<float> row_max, row_sum, correction;  // [ld]
  std::vector<int32_t> position;                    // [ld]: each row's token position
  std::vector<int32_t> first_visible;               // [ld]: each row's window start
  KeyValueRows kv;                                  // [kPaddedKeys]

  void reset(int64_t rows, int64_t head_dim) {
    ld = round_up(rows, kLanes);
    dims = round_up(head_dim, kDimBlock);
    query.assign(head_dim / 2 * ld, 0);
    scores.resize(kPaddedKeys * ld);
    probs.resize(kKeyTile / 2 * ld);
    values.assign(kKeyTile / 2 * dims, 0);
    out.assign(dims * ld, 0.f);
    row_max.assign(ld, kNegInf);
    row_sum.assign(ld, 0.f);
    correction.resize(ld);
    position.assign(ld, std::numeric_limits<int32_t>::max());
    first_visible.assign(ld, std::numeric_limits<int32_t>::min());
    kv.reset(head_dim, kPaddedKeys);
  }
};

// scores[k][v * 16 + lane] = key k . query row (v * 16 + lane), for K keys and V row vectors.
template <int K, int V>
KVSERVE_BF16_TARGET inline void score_block(const uint16_t* const* key_rows, const uint32_t* query,
                                            int64_t pairs, int64_t ld, float* scores) {
  __m512 acc[K][V];
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v) acc[k][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh q[V];
    for (int v = 0; v < V; ++v) q[v] = (__m512bh)_mm512_loadu_si512(query + p * ld + v * kLanes);
    for (int k = 0; k < K; ++k) {
      const auto pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(key_rows[k] + 2 * p)));
      for (int v = 0; v < V; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], pair, q[v]);
    }
  }
  for (int k = 0; k < K; ++k)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(scores + k * ld + v * kLanes, acc[k][v]);
}

template <int V>
KVSERVE_BF16_TARGET void score_keys(Scratch& s, int64_t pairs, int64_t num_keys, int64_t vector) {
  const uint32_t* query = s.query.data() + vector * kLanes;
  float* scores = s.scores.data() + vector * kLanes;
  for (int64_t k = 0; k < num_keys; k += kKeyBlock) {
    score_block<kKeyBlock, V>(s.kv.keys.data() + k, query, pairs, s.ld, scores + k * s.ld);
  }
}

// scores^T for the tile's keys (rounded up to whole key blocks) and every row vector.
KVSERVE_BF16_TARGET void score_tile(Scratch& s, int64_t head_dim, int64_t num_keys) {
  const int64_t vectors = s.ld / kLanes;
  const int64_t pairs = head_dim / 2;
  for (int64_t v = 0; v < vectors; v += kRowVectors) {
    switch (std::min<int64_t>(kRowVectors, vectors - v)) {
      case 4: score_keys<4>(s, pairs, num_keys, v); break;
      case 3: score_keys<3>(s, pairs, num_keys, v); break;
      case 2: score_keys<2>(s, pairs, num_keys, v); break;
      default: score_keys<1>(s, pairs, num_keys, v); break;
    }
  }
}

// Folds one tile into the running softmax, 16 rows per vector: hides keys after each row's
// position and before its window (when the tile crosses the diagonal or a window start),
// turns scores into unnormalised probabilities against the new running max, and records
// each row's rescale factor.
KVSERVE_BF16_TARGET void softmax_tile(Scratch& s, int64_t num_keys, int64_t key_begin,
                                      bool masked, float scale) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512 c = _mm512_set1_ps(scale * kLog2e);  // e^(scale x) = 2^(scale log2e x)
  for (int64_t r = 0; r < s.ld; r += kLanes) {
    float* column = s.scores.data() + r;
    const __m512i position = _mm512_loadu_si512(s.position.data() + r);
    const __m512i first_visible = _mm512_loadu_si512(s.first_visible.data() + r);
    __m512 tile_max = neg_inf;
    for (int64_t n = 0; n < num_keys; ++n) {
      __m512 x = _mm512_loadu_ps(column + n * s.ld);
      if (masked) {
        const __m512i key = _mm512_set1_epi32(static_cast<int>(key_begin + n));
        const __mmask16 hidden = _mm512_cmpgt_epi32_mask(key, position) |
                                 _mm512_cmpgt_epi32_mask(first_visible, key);
        x = _mm512_mask_mov_ps(x, hidden, neg_inf);
        _mm512_storeu_ps(column + n * s.ld, x);
      }
      tile_max = _mm512_max_ps(tile_max, x);
    }
    const __m512 old_max = _mm512_loadu_ps(s.row_max.data() + r);
    const __m512 new_max = _mm512_max_ps(old_max, tile_max);
    // First tile: the old max is -inf and so is the old sum's weight (0, not NaN).
    const __mmask16 seen = _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ);
    const __m512 correction =
        _mm512_maskz_mov_ps(seen, exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), c)));
    const __m512 shift = _mm512_mul_ps(new_max, c);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t n = 0; n < num_keys; ++n) {
      const __m512 x = _mm512_loadu_ps(column + n * s.ld);
      const __mmask16 visible = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
      const __m512 p = _mm512_maskz_mov_ps(visible, exp2_nonpositive(_mm512_fmsub_ps(x, c, shift)));
      _mm512_storeu_ps(column + n * s.ld, p);
      sum = _mm512_add_ps(sum, p);
    }
    const __m512 row_sum = _mm512_loadu_ps(s.row_sum.data() + r);
    _mm512_storeu_ps(s.row_sum.data() + r, _mm512_fmadd_ps(row_sum, correction, sum));
    _mm512_storeu_ps(s.row_max.data() + r, new_max);
    _mm512_storeu_ps(s.correction.data() + r, correction);
  }
}

// probs[j] = (p[2j], p[2j+1]) per row in bf16, and values[j][d] = (v[2j][d], v[2j+1][d]):
// the pair layout vdpbf16ps multiplies. An odd last key pairs with a zero.
KVSERVE_BF16_TARGET void pack_pairs(Scratch& s, int64_t num_keys, int64_t head_dim) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const int64_t pairs = (num_keys + 1) / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const float* even = s.scores.data() + 2 * j * s.ld;
    const bool has_odd = 2 * j + 1 < num_keys;
    for (int64_t r = 0; r < s.ld; r += kLanes) {
      const __m512 a = _mm512_loadu_ps(even + r);
      const __m512 b = has_odd ? _mm512_loadu_ps(even + s.ld + r) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in lanes 0-15, b 16-31
      _mm512_storeu_si512(s.probs.data() + j * s.ld + r, _mm512_permutexvar_epi16(interleave, both));
    }
  }
  interleave_value_pairs(s.kv, pairs, head_dim, s.values.data(), s.dims);
}

// out[d][rows] = out[d][rows] * correction + sum_j values[j][d] . probs[j][rows], for D head
// dims and V row vectors.
template <int D, int V>
KVSERVE_BF16_TARGET inline void output_block(const uint32_t* values, int64_t dims,
                                             const uint32_t* probs, int64_t ld, int64_t pairs,
                                             const float* correction, float* out) {
  __m512 acc[D][V];
  for (int v = 0; v < V; ++v) {
    const __m512 scale = _mm512_loadu_ps(correction + v * kLanes);
    for (int d = 0; d < D; ++d) acc[d][v] = _mm512_mul_ps(_mm512_loadu_ps(out + d * ld + v * kLanes), scale);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh p[V];
    for (int v = 0; v < V; ++v) p[v] = (__m512bh)_mm512_loadu_si512(probs + j * ld + v * kLanes);
    for (int d = 0; d < D; ++d) {
      const auto pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(values[j * dims + d]));
      for (int v = 0; v < V; ++v) acc[d][v] = _mm512_dpbf16_ps(acc[d][v], pair, p[v]);
    }
  }
  for (int d = 0; d < D; ++d)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + d * ld + v * kLanes, acc[d][v]);
}

template <int V>
KVSERVE_BF16_TARGET void output_dims(Scratch& s, int64_t pairs, int64_t vector) {
  const int64_t r = vector * kLanes;
  for (int64_t d = 0; d < s.dims; d += kDimBlock) {
    output_block<kDimBlock, V>(s.values.data() + d, s.dims, s.probs.data() + r, s.ld, pairs,
                               s.correction.data() + r, s.out.data() + d * s.ld + r);
  }
}

KVSERVE_BF16_TARGET void accumulate_output(Scratch& s, int64_t num_keys) {
  const int64_t vectors = s.ld / kLanes;
  const int64_t pairs = (num_keys + 1) / 2;
  for (int64_t v = 0; v < vectors; v += kOutputRowVectors) {
    switch (std::min<int64_t>(kOutputRowVectors, vectors - v)) {
      case 3: output_dims<3>(s, pairs, v); break;
      case 2: output_dims<2>(s, pairs, v); break;
      default: output_dims<1>(s, pairs, v); break;
    }
  }
}

// Packs each row's query pairs (rows in lanes), its position and window start into the
// scratch, and starts its running softmax at its head's sink where there are sinks.
void load_queries(const Bf16Problem& p, const Task& task, Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16* row, at::BFloat16*, int64_t position) {
    const auto* q = reinterpret_cast<const uint16_t*>(row);
    for (int64_t pair = 0; pair < p.head_dim / 2; ++pair) s.query[pair * s.ld + r] = load_pair(q + 2 * pair);
    s.position[r] = static_cast<int32_t>(position);
    if (p.window > 0) s.first_visible[r] = static_cast<int32_t>(window_start(position, p.window));
    if (p.sinks != nullptr) {
      s.row_max[r] = p.sinks[task.head * p.group + r / tile] / p.scale;
      s.row_sum[r] = 1.f;
    }
  });
}

void store_output(const Bf16Problem& p, const Task& task, const Scratch& s) {
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16*, at::BFloat16* dst, int64_t) {
    const float inv_sum = 1.f / s.row_sum[r];
    for (int64_t d = 0; d < p.head_dim; ++d) dst[d] = s.out[d * s.ld + r] * inv_sum;
  });
}

template <typename cache_t>
void run_task(const Bf16Problem& p, const Task& task, Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  s.reset(p.group * tile, p.head_dim);
  load_queries(p, task, s);
  const int64_t first_position = p.computed[task.span] + task.row_begin;
  // Tiles starting before the last row's window start cross some row's window start.
  const int64_t last_window_start = window_start(first_position + tile - 1, p.window);
  for (int64_t key_begin = task.first_key; key_begin < task.keys; key_begin += kKeyTile) {
    const int64_t num_keys = std::min(kKeyTile, task.keys - key_begin);
    s.kv.locate<cache_t>(p, task, key_begin, num_keys);
    score_tile(s, p.head_dim, num_keys);
    if (p.softcap > 0.f) soft_cap(s.scores.data(), num_keys * s.ld, p.softcap / p.scale);
    const bool masked = key_begin + num_keys > first_position + 1 || key_begin < last_window_start;
    softmax_tile(s, num_keys, key_begin, masked, p.scale);
    pack_pairs(s, num_keys, p.head_dim);
    accumulate_output(s, num_keys);
  }
  store_output(p, task, s);
}

}  // namespace

void run_bf16_tiles(const std::vector<Task>& tasks, const Bf16Problem& problem) {
  TORCH_CHECK(bf16_tiles_supported(problem.head_dim), "bf16 prefill tiles need AVX512_BF16");
  run_in_parallel(
      tasks, problem.cache_dtype, [] { return Scratch(); },
      [&](auto tag, const Task& task, Scratch& scratch) {
        run_task<decltype(tag)>(problem, task, scratch);
      });
}

#else

void run_bf16_tiles(const std::vector<Task>&, const Bf16Problem&) {
  TORCH_CHECK(false, "bf16 prefill tiles need an x86-64 build with AVX512_BF16");
}

#endif

}  // namespace kvserve::prefill
