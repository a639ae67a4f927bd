// Prefill attention on AMX tiles, for bf16 models on CPUs with AMX-BF16 (Sapphire Rapids
// and later). One tdpbf16ps multiplies a 16x32 bf16 tile by a 32x16 one into 16x16 float32
// sums: 8192 products per instruction, 16x a vdpbf16ps. The products stop dominating;
// what is left is the softmax (AVX-512, per row) and moving tiles to and from memory.
//
// Same tasks, same online softmax and roundings as prefill_attention_bf16.cpp; rows are in
// the natural layout here, because tiles take rows from memory. Per 32-row block and tile
// of 256 keys (twice the vdpbf16ps kernel's: the per-row softmax work and the output's
// load and store per key tile are spread over more keys; 7% fewer ticks than 128):
//
//   scores [32 rows x keys]  = Q . K^T   Q tiles: 16 query rows x 32 head dims (bf16)
//                                        K tiles: 16 (k[2p], k[2p+1]) pairs x 16 keys, built
//                                        once per key tile by 16x16 dword transposes
//   softmax per row          running max and sum per row; probabilities rounded to bf16
//   out [32 rows x d]       += P . V     P tiles: 16 rows x 32 keys (bf16)
//                                        V tiles: 16 (v[2j][d], v[2j+1][d]) pairs x 16 dims
//
// Both products run in 2x2 blocks of tiles (block_products). The output accumulates in
// float32 in memory: a row's running rescale is applied there, and the tiles load,
// accumulate and store it once per key tile. Needs head_dim % 32 == 0 (whole tiles).
// Linux hands out AMX state only on request (arch_prctl), which amx_prefill_available()
// makes once; KVSERVE_CPU_ISA=avx512 (or avx2) keeps the other kernels, so one machine can
// compare them.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "ops.h"
#include "prefill_attention.h"
#include "prefill_tiles.h"

#if defined(KVSERVE_HAVE_BF16_PREFILL) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVSERVE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define KVSERVE_HAVE_AMX_PREFILL 1
#endif

namespace kvserve::prefill {

#ifdef KVSERVE_HAVE_AMX_PREFILL
namespace {

constexpr int64_t kRows = 16;   // tile rows: query rows or keys
constexpr int64_t kWidth = 32;  // bf16 per tile row: head dims of Q.K, keys of P.V
constexpr int64_t kTileBytes = 64;
constexpr int64_t kBlockRows = 2 * kRows;  // query rows per block of tile products
constexpr int64_t kKeys = 256;             // keys per softmax tile

bool cpu_has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  // Read from CPUID rather than __builtin_cpu_supports: GCC 12's answers "amx-bf16" with 0.
  return (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// Linux (5.16+) lets a process use the 8 KiB tile register file only after asking; the
// grant covers every thread of the process.
bool kernel_grants_tile_data() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) == 0;
}

// Palette 1 with all 8 tiles at their full 16 rows x 64 bytes: every product here uses
// whole tiles (operands are padded with zeros instead).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

KVSERVE_AMX_TARGET void configure_tiles() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.bytes_per_row[i] = kTileBytes;
    config.rows[i] = kRows;
  }
  // GCC 12 does not see ldtilecfg read the struct and drops the stores above; the empty
  // asm that "uses" the memory keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

KVSERVE_AMX_TARGET void release_tiles() { _tile_release(); }

// Per-thread buffers, sized once per task. Padding rows of the query and padding keys stay
// zero, so the products they enter add zeros.
struct Scratch {
  int64_t ld = 0;                // rows, padded to whole blocks
  std::vector<uint16_t> query;   // [ld][head_dim] bf16
  std::vector<int32_t> position; // [ld]: each row's token position (-1 for padding)
  std::vector<uint32_t> keys;    // [head_dim / 2][kKeys]: key n's pair p at [p][n]
  std::vector<uint32_t> values;  // [kKeys / 2][head_dim]: (v[2j][d], v[2j+1][d])
  std::vector<float> scores;     // [kBlockRows][kKeys]
  std::vector<uint16_t> probs;   // [kBlockRows][kKeys] bf16
  std::vector<float> out;        // [ld][head_dim]
  std::vector<float> row_max, row_sum;  // [ld]
  KeyValueRows rows;             // [kKeys]

  void reset(int64_t num_rows, int64_t head_dim) {
    ld = round_up(num_rows, kBlockRows);
    query.assign(ld * head_dim, 0);
    position.assign(ld, -1);
    keys.resize(head_dim / 2 * kKeys);
    values.resize(kKeys / 2 * head_dim);
    scores.resize(kBlockRows * kKeys);
    probs.resize(kBlockRows * kKeys);
    out.assign(ld * head_dim, 0.f);
    row_max.assign(ld, kNegInf);
    row_sum.assign(ld, 0.f);
    rows.reset(head_dim, kKeys);
  }
};

// In place: row i of the result is column i of the 16x16 dword matrix r (unpacks within
// 128-bit lanes make 4x4 blocks, two lane shuffles put the blocks in place).
KVSERVE_AMX_TARGET inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// keys[p][n] = key n's pair p for the tile's first `padded` keys: the pair-major layout a
// tile product's right operand needs, 16 keys x 16 pairs at a time.
KVSERVE_AMX_TARGET void transpose_keys(Scratch& s, int64_t padded, int64_t head_dim) {
  const int64_t pairs = head_dim / 2;
  __m512i r[16];
  for (int64_t n = 0; n < padded; n += kRows) {
    for (int64_t p = 0; p < pairs; p += 16) {
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(s.rows.keys[n + i] + 2 * p);
      transpose_16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(s.keys.data() + (p + i) * kKeys + n, r[i]);
    }
  }
}

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
KVSERVE_AMX_TARGET void score_block(Scratch& s, int64_t block, int64_t keys, int64_t head_dim) {
  for (int64_t n = 0; n < keys; n += kWidth) {
    block_products({reinterpret_cast<const char*>(s.query.data() + block * head_dim),
                    head_dim * 2, kTileBytes,
                    reinterpret_cast<const char*>(s.keys.data() + n), kKeys * 4,
                    kRows * kKeys * 4, reinterpret_cast<char*>(s.scores.data() + n), kKeys * 4,
                    head_dim / kWidth, false});
  }
}

// out[block + i][.] += probs[i][.] . values for 32 rows, over the first `keys` keys (a
// multiple of 32).
KVSERVE_AMX_TARGET void accumulate_block(Scratch& s, int64_t block, int64_t keys,
                                         int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; d += kWidth) {
    block_products({reinterpret_cast<const char*>(s.probs.data()), kKeys * 2, kTileBytes,
                    reinterpret_cast<const char*>(s.values.data() + d), head_dim * 4,
                    kRows * head_dim * 4,
                    reinterpret_cast<char*>(s.out.data() + block * head_dim + d),
                    head_dim * 4, keys / kWidth, true});
  }
}

// 2^t for the softmax's visible scores (t <= 0, finite): exp2_nonpositive without its clamp
// and one degree lower (Taylor to degree 3, relative error < 6e-4, a third of a bf16
// probability's rounding). Lanes it gets garbage for (-inf, NaN) are masked off after.
KVSERVE_AMX_TARGET inline __m512 exp2_probability(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(5.5504108664821580e-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// A mask of the first `count` of 16 lanes (none for count <= 0).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xffff : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// 16 rows' share of a key tile, rows in lanes where the work is per row: each row's first
// visible[i] scores (the rest are after its position, or past the tile) fold into its
// running max and sum; probs gets the unnormalised probabilities in bf16 (zeros after
// visible[i], up to `keys`), and each row's output so far is rescaled to its new max.
KVSERVE_AMX_TARGET void softmax_rows(Scratch& s, int64_t first_row, int64_t tile_row,
                                     const int64_t* visible, int64_t keys, float c,
                                     int64_t head_dim) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  alignas(64) float peak[kRows];
  for (int64_t i = 0; i < kRows; ++i) {
    const float* scores = s.scores.data() + (tile_row + i) * kKeys;
    __m512 top = neg_inf;
    for (int64_t n = 0; n < visible[i]; n += 16) {
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(neg_inf, first_lanes(visible[i] - n), scores + n));
    }
    peak[i] = _mm512_reduce_max_ps(top);
  }
  // Per row, in lanes: the new max, the old sum's weight (0 for a row's first keys: its old
  // max is -inf, and exp2(-inf) must not become NaN) and the exponent's shift.
  float* row_max = s.row_max.data() + first_row;
  const __m512 old_max = _mm512_loadu_ps(row_max);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_load_ps(peak));
  const __mmask16 seen = _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_NEQ_OQ);
  const __m512 scale = _mm512_set1_ps(c);
  alignas(64) float correction[kRows], shift[kRows], sums[kRows];
  _mm512_store_ps(correction, _mm512_maskz_mov_ps(
                                  seen, exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), scale))));
  _mm512_store_ps(shift, _mm512_mul_ps(new_max, scale));
  _mm512_storeu_ps(row_max, new_max);
  for (int64_t i = 0; i < kRows; ++i) {
    const float* scores = s.scores.data() + (tile_row + i) * kKeys;
    uint16_t* probs = s.probs.data() + (tile_row + i) * kKeys;
    const __m512 row_shift = _mm512_set1_ps(shift[i]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t n = 0; n < keys; n += 32) {
      const __m512 a = _mm512_maskz_mov_ps(
          first_lanes(visible[i] - n),
          exp2_probability(_mm512_fmsub_ps(_mm512_loadu_ps(scores + n), scale, row_shift)));
      const __m512 b = _mm512_maskz_mov_ps(
          first_lanes(visible[i] - n - 16),
          exp2_probability(_mm512_fmsub_ps(_mm512_loadu_ps(scores + n + 16), scale, row_shift)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
      _mm512_storeu_si512(probs + n, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a first
    }
    sums[i] = _mm512_reduce_add_ps(sum);
  }
  float* row_sum = s.row_sum.data() + first_row;
  const __m512 weight = _mm512_load_ps(correction);
  _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), weight, _mm512_load_ps(sums)));
  // Rescale the rows whose max moved (usually few after the first tiles).
  const __mmask16 moved = _mm512_cmp_ps_mask(weight, _mm512_set1_ps(1.f), _CMP_NEQ_UQ);
  for (int64_t i = 0; i < kRows; ++i) {
    if (!(moved >> i & 1)) continue;
    float* out = s.out.data() + (first_row + i) * head_dim;
    const __m512 factor = _mm512_set1_ps(correction[i]);
    for (int64_t d = 0; d < head_dim; d += 16) {
      _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(out + d), factor));
    }
  }
}

// Folds keys [key_begin, key_begin + num_keys) into every 32-row block that sees any.
KVSERVE_AMX_TARGET void attend_key_tile(Scratch& s, int64_t key_begin, int64_t num_keys,
                                        int64_t head_dim, float scale) {
  const float c = scale * kLog2e;  // e^(scale x) = 2^(scale log2e x)
  for (int64_t block = 0; block < s.ld; block += kBlockRows) {
    const int32_t* position = s.position.data() + block;
    const int64_t last = *std::max_element(position, position + kBlockRows);
    const int64_t seen = std::min<int64_t>(num_keys, last - key_begin + 1);
    if (seen <= 0) continue;
    const int64_t keys = round_up(seen, kWidth);
    int64_t visible[kBlockRows];  // per row: keys of the tile at or before its position
    for (int64_t i = 0; i < kBlockRows; ++i) {
      visible[i] = std::clamp<int64_t>(position[i] - key_begin + 1, 0, num_keys);
    }
    score_block(s, block, keys, head_dim);
    softmax_rows(s, block, 0, visible, keys, c, head_dim);
    softmax_rows(s, block + kRows, kRows, visible + kRows, keys, c, head_dim);
    accumulate_block(s, block, keys, head_dim);
  }
}

void load_queries(const Bf16Problem& p, const Task& task, Scratch& s) {
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16* q, at::BFloat16*, int64_t position) {
    std::memcpy(s.query.data() + r * p.head_dim, q, p.head_dim * sizeof(uint16_t));
    s.position[r] = static_cast<int32_t>(position);
  });
}

void store_output(const Bf16Problem& p, const Task& task, const Scratch& s) {
  for_each_task_row(p, task, [&](int64_t r, const at::BFloat16*, at::BFloat16* dst, int64_t) {
    const float inv_sum = 1.f / s.row_sum[r];
    const float* src = s.out.data() + r * p.head_dim;
    for (int64_t d = 0; d < p.head_dim; ++d) dst[d] = src[d] * inv_sum;
  });
}

template <typename cache_t>
void run_task(const Bf16Problem& p, const Task& task, Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  s.reset(p.group * tile, p.head_dim);
  load_queries(p, task, s);
  for (int64_t key_begin = 0; key_begin < task.keys; key_begin += kKeys) {
    const int64_t num_keys = std::min(kKeys, task.keys - key_begin);
    const int64_t padded = round_up(num_keys, kWidth);
    s.rows.locate<cache_t>(p, task, key_begin, num_keys);
    transpose_keys(s, padded, p.head_dim);
    interleave_value_pairs(s.rows, padded / 2, p.head_dim, s.values.data(), p.head_dim);
    attend_key_tile(s, key_begin, num_keys, p.head_dim, p.scale);
  }
  store_output(p, task, s);
}

}  // namespace

}  // namespace kvserve::prefill

namespace kvserve {

bool amx_prefill_available() {
  static const bool available = amx_kernels_allowed() && bf16_linear_supported() &&
                                prefill::cpu_has_amx_bf16() && prefill::kernel_grants_tile_data();
  return available;
}

}  // namespace kvserve

namespace kvserve::prefill {

bool amx_tiles_supported(int64_t head_dim) {
  return amx_prefill_available() && head_dim % kWidth == 0;
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
  run_in_parallel(
      tasks, problem.cache_dtype, [] { return TileScratch(); },
      [&](auto tag, const Task& task, TileScratch& scratch) {
        run_task<decltype(tag)>(problem, task, scratch);
      });
}

#else

}  // namespace kvserve::prefill

namespace kvserve {

bool amx_prefill_available() { return false; }

}  // namespace kvserve

namespace kvserve::prefill {

bool amx_tiles_supported(int64_t) { return false; }

void run_amx_tiles(const std::vector<Task>&, const Bf16Problem&) {
  TORCH_CHECK(false, "AMX prefill tiles need an x86-64 Linux build");
}

#endif

}  // namespace kvserve::prefill
