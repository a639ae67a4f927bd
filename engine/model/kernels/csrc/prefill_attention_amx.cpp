// Prefill attention on AMX tiles, for bf16 models on CPUs with AMX-BF16 (Sapphire Rapids
// and later). One tdpbf16ps multiplies a 16x32 bf16 tile by a 32x16 one into 16x16 float32
// sums: 8192 products per instruction, 16x a vdpbf16ps. The products stop dominating;
// what is left is the softmax (AVX-512, per row) and moving tiles to and from memory.
//
// Same tasks and online softmax as prefill_attention_bf16.cpp; rows are in the natural
// layout here, because tiles take rows from memory. Each (span, KV head)'s context is
// packed once per call into the layout the products read (PackedContext: every query tile
// of the span reads the same keys). Per 32-row block and tile of 128 keys:
//
//   scores [32 rows x keys]  = Q . K^T   Q tiles: 16 query rows x 32 head dims (bf16)
//                                        K tiles: 16 (k[2p], k[2p+1]) pairs x 16 keys
//   softmax per row          against the row's running max (softmax_row); probabilities
//                            rounded to bf16, sums kept in 16 lanes per row
//   out [32 rows x d]       += P . V     P tiles: 16 rows x 32 keys (bf16)
//                                        V tiles: 16 (v[2j][d], v[2j+1][d]) pairs x 16 dims
//
// Both products run in 2x2 blocks of tiles (block_products). The output accumulates in
// float32 in memory: a row's rare rescale is applied there, and the tiles load,
// accumulate and store it once per key tile. Every buffer a tile reads or writes is on
// 64-byte lines (LineVector): rows straddling two lines made the kernel a fifth slower.
// With a sliding window each span's packed context starts at its first row's window
// start, a task at the tile holding its own, and rows mask the keys before their window as
// they mask those after their position; a soft cap maps each block's scores (in the
// unscaled units the softmax reads, cap / scale) and a sink starts a row's running max.
// Needs head_dim % 32 == 0 (whole tiles). Linux hands out AMX state only on request
// (arch_prctl), which amx_available() makes once; KVSERVE_CPU_ISA=avx512 (or avx2)
// keeps the other kernels, so one machine can compare them.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "amx_tiles.h"
#include "common.h"
#include "ops.h"
#include "prefill_attention.h"
#include "prefill_tiles.h"

#if defined(KVSERVE_HAVE_BF16_PREFILL) && defined(KVSERVE_HAVE_AMX)
#define KVSERVE_HAVE_AMX_PREFILL 1
#endif

namespace kvserve::prefill {

#ifdef KVSERVE_HAVE_AMX_PREFILL
namespace {

constexpr int64_t kRows = 16;   // tile rows: query rows or keys
constexpr int64_t kWidth = 32;  // bf16 per tile row: head dims of Q.K, keys of P.V
constexpr int64_t kTileBytes = 64;
constexpr int64_t kBlockRows = 2 * kRows;  // query rows per block of tile products
constexpr int64_t kKeys = kKeyTile;        // keys per softmax tile, as the other kernels

using amx::configure_tiles;
using amx::release_tiles;
using amx::transpose_16x16;

// Per-thread buffers, sized once per task. Padding rows of the query stay zero, so the
// products they enter add zeros (padding keys are zeros in PackedContext).
struct Scratch {
  int64_t ld = 0;                // rows, padded to whole blocks
  LineVector<uint16_t> query;    // [ld][head_dim] bf16
  std::vector<int32_t> position; // [ld]: each row's token position (-1 for padding)
  LineVector<float> scores;      // [kBlockRows][kKeys]
  LineVector<uint16_t> probs;    // [kBlockRows][kKeys] bf16
  LineVector<float> out;         // [ld][head_dim]
  std::vector<float> row_max;    // [ld]
  LineVector<float> row_sums;    // [ld][16]: lane sums of each row's probabilities

  void reset(int64_t num_rows, int64_t head_dim) {
    ld = round_up(num_rows, kBlockRows);
    query.assign(ld * head_dim, 0);
    position.assign(ld, -1);
    scores.resize(kBlockRows * kKeys);
    probs.resize(kBlockRows * kKeys);
    out.assign(ld * head_dim, 0.f);
    row_max.assign(ld, kNegInf);
    row_sums.assign(ld * 16, 0.f);
  }
};

// dst[p][n] = key n's pair p for the first `padded` keys of `rows`: the pair-major layout a
// tile product's right operand needs, 16 keys x 16 pairs at a time.
KVSERVE_AMX_TARGET void transpose_keys(const KeyValueRows& rows, int64_t padded,
                                       int64_t head_dim, uint32_t* dst) {
  const int64_t pairs = head_dim / 2;
  __m512i r[16];
  for (int64_t n = 0; n < padded; n += kRows) {
    for (int64_t p = 0; p < pairs; p += 16) {
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows.keys[n + i] + 2 * p);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * kKeys + n, r[i]);
    }
  }
}

// Every (span, KV head)'s context in the layouts the tile products read, packed once per
// call in tiles of kKeys keys: all the query tiles of a span (32 for a 2,048-token chunk)
// read the same key tiles, and packing them per task took a sixth of the kernel's time.
// A span's tiles start at its origin: key 0, or with a sliding window its first row's
// window start (keys before it are never read). Columns past a tile's keys, up to the
// next multiple of 32, are zeros.
class PackedContext {
 public:
  PackedContext(const std::vector<Task>& tasks, const Bf16Problem& p)
      : head_dim_(p.head_dim), kv_heads_(p.num_heads / p.group) {
    int64_t spans = 0;
    for (const Task& t : tasks) spans = std::max(spans, t.span + 1);
    std::vector<int64_t> span_keys(spans, 0);  // per span: what its last row attends to
    origins_.assign(spans, std::numeric_limits<int64_t>::max());
    for (const Task& t : tasks) {
      span_keys[t.span] = std::max(span_keys[t.span], t.keys);
      origins_[t.span] = std::min(origins_[t.span], t.first_key);
    }
    first_tile_.assign(spans * kv_heads_ + 1, 0);
    for (int64_t i = 0; i < spans * kv_heads_; ++i) {
      const int64_t span = i / kv_heads_;
      first_tile_[i + 1] = first_tile_[i] + (span_keys[span] - origins_[span] + kKeys - 1) / kKeys;
    }
    const int64_t tiles = first_tile_.back();
    keys_.resize(tiles * tile_elements());  // written before read: not zeroed
    values_.resize(tiles * tile_elements());
    with_cache_type(p.cache_dtype, [&](auto tag) { pack<decltype(tag)>(p, span_keys); });
  }

  // The first key of the task's span's tile 0.
  int64_t origin(const Task& t) const { return origins_[t.span]; }
  // Key tile `tile` of the task's (span, KV head): [head_dim / 2][kKeys] key pairs.
  const uint32_t* keys(const Task& t, int64_t tile) const {
    return keys_.data() + (first(t) + tile) * tile_elements();
  }
  // Its values: [kKeys / 2][head_dim] pairs (v[2j][d], v[2j + 1][d]).
  const uint32_t* values(const Task& t, int64_t tile) const {
    return values_.data() + (first(t) + tile) * tile_elements();
  }

 private:
  int64_t tile_elements() const { return head_dim_ / 2 * kKeys; }
  int64_t first(const Task& t) const { return first_tile_[t.span * kv_heads_ + t.head]; }

  template <typename cache_t>
  void pack(const Bf16Problem& p, const std::vector<int64_t>& span_keys) {
    at::parallel_for(0, first_tile_.back(), 1, [&](int64_t begin, int64_t end) {
      KeyValueRows rows;
      rows.reset(p.head_dim, kKeys);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t owner = std::upper_bound(first_tile_.begin(), first_tile_.end(), tile) -
                              first_tile_.begin() - 1;  // (span, head) index
        const Task where{owner / kv_heads_, owner % kv_heads_, 0, 0, 0, 0};
        const int64_t key_begin = origins_[where.span] + (tile - first_tile_[owner]) * kKeys;
        const int64_t count = std::min(kKeys, span_keys[where.span] - key_begin);
        const int64_t padded = round_up(count, kWidth);
        rows.locate<cache_t>(p, where, key_begin, count);
        transpose_keys(rows, padded, p.head_dim, keys_.data() + tile * tile_elements());
        interleave_value_pairs(rows, padded / 2, p.head_dim,
                               values_.data() + tile * tile_elements(), p.head_dim);
      }
    });
  }

  int64_t head_dim_, kv_heads_;
  std::vector<int64_t> origins_;     // [spans]: each span's first packed key
  std::vector<int64_t> first_tile_;  // [spans * kv heads + 1]: where each one's tiles start
  LineVector<uint32_t> keys_, values_;
};

// A 32x32 float32 block of tiles: c = (accumulate ? c : 0) + sum over `steps` of
// a_t [32 x 32 bf16] . b_t [32 x 32]. Tiles 0-3 hold the sums (rows 0-15 and 16-31 by
// columns 0-15 and 16-31), 4-5 the two row halves of a_t, 6-7 the two column halves of b_t:
// every operand tile loaded feeds two products, and no load waits on the tile it replaces
// for longer than one product (a single left tile reused across four products stalled
// each step's reload, ~2x slower).
struct BlockOperands {
  const char* a;
  int64_t a_stride, a_step;  // bytes: between rows, between steps
  const char* b;
  int64_t b_stride, b_step;  // bytes: between rows, between steps
  char* c;
  int64_t c_stride;  // bytes between rows
  int64_t steps;
  bool accumulate;
};

KVSERVE_AMX_TARGET inline void block_products(const BlockOperands& o) {
  char* c_low = o.c + kRows * o.c_stride;
  if (o.accumulate) {
    _tile_loadd(0, o.c, o.c_stride);
    _tile_loadd(1, o.c + kTileBytes, o.c_stride);
    _tile_loadd(2, c_low, o.c_stride);
    _tile_loadd(3, c_low + kTileBytes, o.c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < o.steps; ++t) {
    const char* a = o.a + t * o.a_step;
    const char* b = o.b + t * o.b_step;
    _tile_loadd(4, a, o.a_stride);
    _tile_loadd(6, b, o.b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + kRows * o.a_stride, o.a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, b + kTileBytes, o.b_stride);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, o.c, o.c_stride);
  _tile_stored(1, o.c + kTileBytes, o.c_stride);
  _tile_stored(2, c_low, o.c_stride);
  _tile_stored(3, c_low + kTileBytes, o.c_stride);
}

// scores[i][n] = query row (block + i) . key n for 32 rows and the first `keys` keys (a
// multiple of 32).
KVSERVE_AMX_TARGET void score_block(Scratch& s, const uint32_t* packed_keys, int64_t block,
                                    int64_t keys, int64_t head_dim) {
  for (int64_t n = 0; n < keys; n += kWidth) {
    block_products({reinterpret_cast<const char*>(s.query.data() + block * head_dim),
                    head_dim * 2, kTileBytes,
                    reinterpret_cast<const char*>(packed_keys + n), kKeys * 4,
                    kRows * kKeys * 4, reinterpret_cast<char*>(s.scores.data() + n), kKeys * 4,
                    head_dim / kWidth, false});
  }
}

// out[block + i][.] += probs[i][.] . values for 32 rows, over the first `keys` keys (a
// multiple of 32).
KVSERVE_AMX_TARGET void accumulate_block(Scratch& s, const uint32_t* packed_values,
                                         int64_t block, int64_t keys, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; d += kWidth) {
    block_products({reinterpret_cast<const char*>(s.probs.data()), kKeys * 2, kTileBytes,
                    reinterpret_cast<const char*>(packed_values + d), head_dim * 4,
                    kRows * head_dim * 4,
                    reinterpret_cast<char*>(s.out.data() + block * head_dim + d),
                    head_dim * 4, keys / kWidth, true});
  }
}

// 2^t for the softmax's probabilities (t finite and not far above 0): t = n + f with
// |f| <= 1/2, 2^f by its minimax cubic (relative error < 7.5e-5, a 25th of a bf16
// probability's rounding), scaled by 2^n. n comes from the float adder (adding 1.5 x 2^23
// rounds to an integer; the build has no -ffast-math to fold it), cheaper here than
// vroundscaleps. Lanes it gets garbage for (-inf, NaN) are masked off after.
KVSERVE_AMX_TARGET inline __m512 exp2_probability(__m512 t) {
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, round), round);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(5.517156199e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.426108714e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.932609797e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999280886e-1f));
  return _mm512_scalef_ps(y, n);
}

// A mask of the first `count` of 16 lanes (none for count <= 0).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xffff : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// A mask of lanes [from, to) of 16 (first_lanes(to) where from <= 0).
inline __mmask16 lanes_between(int64_t from, int64_t to) {
  return first_lanes(to) & static_cast<__mmask16>(~first_lanes(from));
}

// The largest of a row's scores [from, visible).
KVSERVE_AMX_TARGET inline float visible_max(const float* scores, int64_t from, int64_t visible) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 top = neg_inf;
  for (int64_t n = 0; n < visible; n += 16) {
    const __mmask16 lanes = lanes_between(from - n, visible - n);
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(neg_inf, lanes, scores + n));
  }
  return _mm512_reduce_max_ps(top);
}

// probs[n] = 2^(scores[n] c - shift) in bf16 for the keys [from, visible), zeros elsewhere
// up to `keys` (a multiple of 32); returns the probabilities' lane sums and folds the
// visible scores into the lane maxima *top. Most rows see the whole tile (kWhole): no
// masks then.
template <bool kWhole>
KVSERVE_AMX_TARGET inline __m512 exponentiate_row(const float* scores, uint16_t* probs,
                                                  int64_t from, int64_t visible, int64_t keys,
                                                  __m512 c, __m512 shift, __m512* top) {
  __m512 sum = _mm512_setzero_ps(), top_low = *top, top_high = *top;
  for (int64_t n = 0; n < keys; n += 32) {
    const __m512 x = _mm512_loadu_ps(scores + n), y = _mm512_loadu_ps(scores + n + 16);
    __m512 a = exp2_probability(_mm512_fmsub_ps(x, c, shift));
    __m512 b = exp2_probability(_mm512_fmsub_ps(y, c, shift));
    if constexpr (kWhole) {
      top_low = _mm512_max_ps(top_low, x);
      top_high = _mm512_max_ps(top_high, y);
    } else {
      const __mmask16 low = lanes_between(from - n, visible - n);
      const __mmask16 high = lanes_between(from - n - 16, visible - n - 16);
      top_low = _mm512_mask_max_ps(top_low, low, top_low, x);
      top_high = _mm512_mask_max_ps(top_high, high, top_high, y);
      a = _mm512_maskz_mov_ps(low, a);
      b = _mm512_maskz_mov_ps(high, b);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
    _mm512_storeu_si512(probs + n, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a first
  }
  *top = _mm512_max_ps(top_low, top_high);
  return sum;
}

KVSERVE_AMX_TARGET inline __m512 exponentiate(const float* scores, uint16_t* probs,
                                              int64_t from, int64_t visible, int64_t keys,
                                              __m512 c, float shift, __m512* top) {
  const __m512 shifts = _mm512_set1_ps(shift);
  return from <= 0 && visible >= keys
             ? exponentiate_row<true>(scores, probs, from, visible, keys, c, shifts, top)
             : exponentiate_row<false>(scores, probs, from, visible, keys, c, shifts, top);
}

// One row's share of a key tile: its scores [from, visible) (the others are before its
// window, after its position, or past the tile) become bf16 probabilities in probs (zeros
// elsewhere up to `keys`) and fold into its running lane sums. The probabilities are
// computed against the row's running max first, so the usual tile, whose scores stay
// below it, needs no max of its own, no reduction and no correction of the output; only a
// row's first keys and the tile that raises its max (a few per row) pay for those, and the
// latter is recomputed.
KVSERVE_AMX_TARGET void softmax_row(Scratch& s, int64_t r, int64_t tile_row, int64_t from,
                                    int64_t visible, int64_t keys, float c, int64_t head_dim) {
  const float* scores = s.scores.data() + tile_row * kKeys;
  uint16_t* probs = s.probs.data() + tile_row * kKeys;
  if (visible <= from) {
    std::memset(probs, 0, keys * sizeof(uint16_t));
    return;
  }
  float& row_max = s.row_max[r];
  if (row_max == kNegInf) row_max = visible_max(scores, from, visible);
  const __m512 scale = _mm512_set1_ps(c);
  __m512 top = _mm512_set1_ps(kNegInf);
  __m512 sum = exponentiate(scores, probs, from, visible, keys, scale, row_max * c, &top);
  float* sums = s.row_sums.data() + r * 16;
  if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(row_max), _CMP_GT_OQ)) {
    const float new_max = _mm512_reduce_max_ps(top);
    const __m512 factor = _mm512_set1_ps(std::exp2((row_max - new_max) * c));
    float* out = s.out.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16) {
      _mm512_store_ps(out + d, _mm512_mul_ps(_mm512_load_ps(out + d), factor));
    }
    _mm512_store_ps(sums, _mm512_mul_ps(_mm512_load_ps(sums), factor));
    row_max = new_max;
    sum = exponentiate(scores, probs, from, visible, keys, scale, new_max * c, &top);
  }
  _mm512_store_ps(sums, _mm512_add_ps(_mm512_load_ps(sums), sum));
}

// Folds keys [key_begin, key_begin + num_keys) into every 32-row block that sees any.
KVSERVE_AMX_TARGET void attend_key_tile(Scratch& s, const Bf16Problem& p,
                                        const uint32_t* keys_tile, const uint32_t* values_tile,
                                        int64_t key_begin, int64_t num_keys) {
  const int64_t head_dim = p.head_dim;
  const float c = p.scale * kLog2e;  // e^(scale x) = 2^(scale log2e x)
  for (int64_t block = 0; block < s.ld; block += kBlockRows) {
    const int32_t* position = s.position.data() + block;
    const int64_t last = *std::max_element(position, position + kBlockRows);
    const int64_t seen = std::min<int64_t>(num_keys, last - key_begin + 1);
    if (seen <= 0) continue;
    const int64_t keys = round_up(seen, kWidth);
    // Per row: the tile's keys [from, visible) lie in its window, at or before its position.
    int64_t from[kBlockRows], visible[kBlockRows];
    bool any = false;
    for (int64_t i = 0; i < kBlockRows; ++i) {
      visible[i] = std::clamp<int64_t>(position[i] - key_begin + 1, 0, num_keys);
      from[i] = std::clamp<int64_t>(window_start(position[i], p.window) - key_begin, 0, num_keys);
      any = any || from[i] < visible[i];
    }
    if (!any) continue;  // every row's window starts past this tile
    score_block(s, keys_tile, block, keys, head_dim);
    for (int64_t i = 0; p.softcap > 0.f && i < kBlockRows; ++i) {
      soft_cap(s.scores.data() + i * kKeys, keys, p.softcap / p.scale);
    }
    for (int64_t i = 0; i < kBlockRows; ++i) {
      softmax_row(s, block + i, i, from[i], visible[i], keys, c, head_dim);
    }
    accumulate_block(s, values_tile, block, keys, head_dim);
  }
}

// Copies each row's query and position into the scratch, and starts its running softmax
// at its head's sink where there are sinks (its lane sums at exp(sink - sink) = 1). A sink
// of -inf weighs nothing and is left out: softmax_row takes a -inf running max for a row
// with no keys yet, whose sums it never rescales.
void load_queries(const Bf16Problem& p, const Task& task, Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16* q, at::BFloat16*, int64_t position) {
    std::memcpy(s.query.data() + r * p.head_dim, q, p.head_dim * sizeof(uint16_t));
    s.position[r] = static_cast<int32_t>(position);
    const float sink = p.sinks != nullptr ? p.sinks[task.head * p.group + r / tile] : kNegInf;
    if (sink > kNegInf) {
      s.row_max[r] = sink / p.scale;
      s.row_sums[r * 16] = 1.f;
    }
  });
}

void store_output(const Bf16Problem& p, const Task& task, const Scratch& s) {
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16*, at::BFloat16* dst, int64_t) {
    const float* sums = s.row_sums.data() + r * 16;
    const float inv_sum = 1.f / std::accumulate(sums, sums + 16, 0.f);
    const float* src = s.out.data() + r * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) dst[d] = src[d] * inv_sum;
  });
}

void run_task(const Bf16Problem& p, const PackedContext& context, const Task& task,
              Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  s.reset(p.group * tile, p.head_dim);
  load_queries(p, task, s);
  // From the packed tile that holds the task's first key: earlier ones no row sees.
  const int64_t origin = context.origin(task);
  for (int64_t k = (task.first_key - origin) / kKeys; origin + k * kKeys < task.keys; ++k) {
    const int64_t key_begin = origin + k * kKeys;
    attend_key_tile(s, p, context.keys(task, k), context.values(task, k), key_begin,
                    std::min(kKeys, task.keys - key_begin));
  }
  store_output(p, task, s);
}

}  // namespace

bool amx_tiles_supported(int64_t head_dim) {
  return amx_available() && head_dim % kWidth == 0;
}

void run_amx_tiles(const std::vector<Task>& tasks, const Bf16Problem& problem) {
  TORCH_CHECK(amx_tiles_supported(problem.head_dim), "AMX prefill tiles need AMX-BF16");
  // Tile configuration is per thread: each worker loads it with its scratch and releases
  // the tiles when the scratch goes.
  struct TileScratch : Scratch {
    TileScratch() { configure_tiles(); }
    TileScratch(const TileScratch&) = delete;
    ~TileScratch() { release_tiles(); }
  };
  const PackedContext context(tasks, problem);
  run_in_parallel(
      tasks, problem.cache_dtype, [] { return TileScratch(); },
      [&](auto, const Task& task, TileScratch& scratch) {
        run_task(problem, context, task, scratch);
      });
}

#else

bool amx_tiles_supported(int64_t) { return false; }

void run_amx_tiles(const std::vector<Task>&, const Bf16Problem&) {
  TORCH_CHECK(false, "AMX prefill tiles need an x86-64 Linux build");
}

#endif

}  // namespace kvserve::prefill
