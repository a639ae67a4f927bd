// Group-wise 4-bit linear: float32 or bf16 activations against asymmetric 4-bit weights in
// llama.cpp's Q4_1 quantization (groups of 32 input channels, a float16 scale d and minimum
// m per group, w = d * q + m with q in 0..15), stored row-interleaved.
//
// Layout (engine/model/quant_linear.py, interleave_int4): output rows go in blocks of 16
// (the last block holds the R < 16 left over: exactly Q4_1's bytes, nothing padded). In a
// block of R rows, group g is 16R bytes of codes: four chunks of 4R bytes, chunk c holding
// for each row 4 bytes whose low nibbles are the group's elements 4c..4c+3 and high nibbles
// elements 16+4c..16+4c+3. Its params are R scales d, then R minimums m (float16).
//
// y[r, n] = sum_g d[n,g] * (x[r, g] . q[n, g]) + m[n,g] * sum(x[r, g]): the minimum is
// applied once per group through the group sums of x (exact float sums, once per call).
//
// Up to eight rows (decode) the dot products are integer, as llama.cpp's Q4_1 x Q8_1: each
// activation group of 32 is quantized to int8 with its own scale (max|x| / 127). A 64-byte
// chunk of a full block, its nibbles masked, is four codes of each of 16 output rows, one
// row per 32-bit lane: vpdpbusd (VNNI) or vpmaddubsw (AVX2) against four activations
// broadcast to every lane gives 16 rows' partial dots at once, and each group's scales,
// minimums and float math are one vector operation for the 16 rows. The row-major Q4_1
// layout this replaces unpacked, scaled and reduced one row at a time: compute-bound at
// ~20-34 GB/s on two Zen 4 cores, where this reads at the memory's rate.
//
// More rows dequantize a block to floats once, k-major (16 rows' weights per input
// channel), and multiply it by broadcast activations: exact activations, FMA-bound.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "ops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define KVSERVE_HAVE_VNNI_KERNEL 1
#endif

namespace kvserve {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;                          // INT4_BLOCK_ROWS in quant_linear.py
constexpr int64_t kChunks = 4;                              // per group
constexpr int64_t kBlockGroupBytes = kBlockRows * kGroup / 2;  // a full block's group: 256
constexpr int64_t kBlockGroupParams = 2 * kBlockRows;          // 16 scales, 16 minimums
// Activation rows up to this count take the integer path (decode steps); more rows
// dequantize each block to float once and reuse it, exact in the activations (prefill).
constexpr int64_t kIntegerMaxRows = 8;
// Activation rows that share one unpacked block group on the integer path.
constexpr int64_t kRowBlock = 4;

inline float half_to_float(const at::Half h) {
#ifdef KVSERVE_AVX2
  return _cvtsh_ss(h.x);  // one F16C instruction instead of c10's bit manipulation
#else
  return static_cast<float>(h);
#endif
}

// Four activation bytes as one 32-bit lane value, for broadcasting.
inline int32_t four_bytes(const int8_t* p) {
  int32_t value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

// One block's codes and params, always in a full block's layout (16 rows).
struct BlockView {
  const uint8_t* codes;    // groups x 256 bytes
  const at::Half* params;  // groups x 32
};

// Where the dot loops ask for lines into L2 as they read a block: the same group of a block
// prefetch_plan().distance bytes of codes ahead (and as many blocks ahead in the params), or
// null codes for none. One line asked per line read, spread through the loop: asking for a
// block's ~5-15 KiB in one burst before its loop (as this kernel did) filled the miss
// queue, and the loop's own loads waited behind the burst: a sampling profile of a served
// int4 decode put 13% of all samples on those prefetch instructions.
struct Ahead {
  const char* codes = nullptr;
  const char* params = nullptr;
};

inline void prefetch_group(const Ahead& ahead, int64_t g) {
  if (ahead.codes == nullptr) return;
  constexpr int64_t kParamBytes = kBlockGroupParams * sizeof(at::Half);  // one line
  prefetch_lines_l2_kept(ahead.codes + g * kBlockGroupBytes, kBlockGroupBytes);
  prefetch_lines_l2_kept(ahead.params + g * kParamBytes, kParamBytes);
}

// The last block of R < 16 rows rewritten in a full block's layout, rows R..15 zero, so
// every kernel reads 16-row blocks (a few KiB copied per call, for the tail only).
struct PaddedTail {
  std::vector<uint8_t> codes;
  std::vector<at::Half> params;
};

PaddedTail pad_tail(const uint8_t* codes, const at::Half* params, int64_t rows, int64_t groups) {
  PaddedTail tail{std::vector<uint8_t>(groups * kBlockGroupBytes, 0),
                  std::vector<at::Half>(groups * kBlockGroupParams, at::Half(0.f))};
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < kChunks; ++c) {
      std::memcpy(tail.codes.data() + g * kBlockGroupBytes + c * 4 * kBlockRows,
                  codes + g * 16 * rows + c * 4 * rows, 4 * rows);
    }
    const at::Half* src = params + g * 2 * rows;
    at::Half* dst = tail.params.data() + g * kBlockGroupParams;
    std::copy(src, src + rows, dst);
    std::copy(src + rows, src + 2 * rows, dst + kBlockRows);
  }
  return tail;
}

// The blocks of a [outs, in] weight: views of the full ones, a padded copy of the tail.
class Blocks {
 public:
  Blocks(const uint8_t* codes, const at::Half* params, int64_t outs, int64_t in)
      : codes_(codes), params_(params), groups_(in / kGroup), outs_(outs),
        full_(outs / kBlockRows) {
    if (full_ * kBlockRows < outs) {
      tail_ = pad_tail(codes + full_ * kBlockRows * in / 2,
                       params + full_ * kBlockRows * groups_ * 2, outs - full_ * kBlockRows,
                       groups_);
    }
  }
  int64_t count() const { return (outs_ + kBlockRows - 1) / kBlockRows; }
  // Groups of 32 input columns (each block holds `groups` x 256 code bytes, x 32 params).
  int64_t groups() const { return groups_; }
  // Whether block b is the padded copy of the tail (held apart from the full blocks).
  bool padded(int64_t b) const { return b == full_; }
  // Just past the full blocks among [0, end): where a stream through them stops.
  BlockView stream_end(int64_t end) const {
    const int64_t b = std::min(end, full_);
    return {codes_ + b * groups_ * kBlockGroupBytes, params_ + b * groups_ * kBlockGroupParams};
  }
  // Output rows block b holds.
  int64_t rows(int64_t b) const { return std::min(kBlockRows, outs_ - b * kBlockRows); }
  BlockView operator[](int64_t b) const {
    if (b == full_) return {tail_.codes.data(), tail_.params.data()};
    return {codes_ + b * groups_ * kBlockGroupBytes, params_ + b * groups_ * kBlockGroupParams};
  }

 private:
  const uint8_t* codes_;
  const at::Half* params_;
  int64_t groups_, outs_, full_;
  PaddedTail tail_;
};

// Activation rows quantized per group of 32 for the integer dot products: int8 values
// (x * 127 / max|x|, rounded to nearest even), the scale back (max|x| / 127), and the
// group's exact float sum for the minimum term.
struct QuantizedRows {
  int64_t groups = 0;
  std::vector<int8_t> values;  // [rows, in]
  std::vector<float> scales;   // [rows, groups]
  std::vector<float> sums;     // [rows, groups]
};

template <typename scalar_t>
QuantizedRows quantize_rows(const scalar_t* x, int64_t rows, int64_t in) {
  QuantizedRows out;
  out.groups = in / kGroup;
  out.values.resize(rows * in);
  out.scales.resize(rows * out.groups);
  out.sums.resize(rows * out.groups);
  for (int64_t at = 0; at < rows * out.groups; ++at) {
    const scalar_t* src = x + at * kGroup;
    int8_t* dst = out.values.data() + at * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) {
      const float value = static_cast<float>(src[j]);
      amax = std::max(amax, std::fabs(value));
      sum += value;
    }
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
#ifdef KVSERVE_AVX2
    // Round to nearest even (the default MXCSR mode), pack to int8 (values within +-127),
    // and undo the lane interleaving the two packs introduce.
    __m256i lanes[4];
    for (int j = 0; j < 4; ++j) {
      lanes[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(src + 8 * j), _mm256_set1_ps(inverse)));
    }
    const __m256i words = _mm256_packs_epi32(lanes[0], lanes[1]);
    const __m256i words2 = _mm256_packs_epi32(lanes[2], lanes[3]);
    const __m256i bytes = _mm256_packs_epi16(words, words2);
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
#else
    for (int64_t j = 0; j < kGroup; ++j) dst[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(src[j]) * inverse));
#endif
    out.scales[at] = amax / 127.f;
    out.sums[at] = sum;
  }
  return out;
}

#ifdef KVSERVE_AVX2
// M activation rows against one block: out[m * 16 + lane] for the block's 16 rows, each
// half of 8 rows in turn. Per chunk and row, two vpmaddubsw (u8 codes x s8 activations
// into int16 pairs, at most 2 x 15 x 127) accumulate in int16: the 8 of a group reach at
// most 8 x 3,810 = 30,480, so one vpmaddwd per group widens them exactly.
template <int M>
void block_dots_avx2(const QuantizedRows& x, int64_t first_row, BlockView block, Ahead ahead,
                     float* out) {
  const int64_t groups = x.groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[M], minimum_acc[M];
    for (int m = 0; m < M; ++m) acc[m] = minimum_acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (half == 0) prefetch_group(ahead, g);
      const uint8_t* codes = block.codes + g * kBlockGroupBytes + 32 * half;
      const at::Half* params = block.params + g * kBlockGroupParams + 8 * half;
      __m256i dots[M];
      for (int m = 0; m < M; ++m) dots[m] = _mm256_setzero_si256();
      for (int c = 0; c < kChunks; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c));
        const __m256i low = _mm256_and_si256(raw, nibble);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        for (int m = 0; m < M; ++m) {
          const int8_t* xg = x.values.data() + ((first_row + m) * groups + g) * kGroup;
          const __m256i xl = _mm256_set1_epi32(four_bytes(xg + 4 * c));
          const __m256i xh = _mm256_set1_epi32(four_bytes(xg + 16 + 4 * c));
          dots[m] = _mm256_add_epi16(dots[m], _mm256_maddubs_epi16(low, xl));
          dots[m] = _mm256_add_epi16(dots[m], _mm256_maddubs_epi16(high, xh));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params)));
      const __m256 minimum = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(params + kBlockRows)));
      for (int m = 0; m < M; ++m) {
        const int64_t at = (first_row + m) * groups + g;
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dots[m], ones));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(sums, _mm256_set1_ps(x.scales[at])), d, acc[m]);
        minimum_acc[m] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x.sums[at]), minimum_acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      _mm256_storeu_ps(out + m * kBlockRows + 8 * half, _mm256_add_ps(acc[m], minimum_acc[m]));
    }
  }
}
#endif

#ifdef KVSERVE_HAVE_VNNI_KERNEL
// block_dots_avx2 with VNNI: the 16 rows in one register, one vpdpbusd per chunk and
// nibble half (int32 accumulation), two chains per row so consecutive ones overlap.
template <int M>
KVSERVE_VNNI_TARGET void block_dots_vnni(const QuantizedRows& x, int64_t first_row,
                                         BlockView block, Ahead ahead, float* out) {
  const int64_t groups = x.groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[M], minimum_acc[M];
  for (int m = 0; m < M; ++m) acc[m] = minimum_acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group(ahead, g);
    const uint8_t* codes = block.codes + g * kBlockGroupBytes;
    const at::Half* params = block.params + g * kBlockGroupParams;
    __m512i low[kChunks], high[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i raw = _mm512_loadu_si512(codes + 64 * c);
      low[c] = _mm512_and_si512(raw, nibble);
      high[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(params)));
    const __m512 minimum = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(params + kBlockRows)));
    for (int m = 0; m < M; ++m) {
      const int64_t at = (first_row + m) * groups + g;
      const int8_t* xg = x.values.data() + at * kGroup;
      __m512i dots_low = _mm512_setzero_si512(), dots_high = _mm512_setzero_si512();
      for (int c = 0; c < kChunks; ++c) {
        dots_low = _mm512_dpbusd_epi32(dots_low, low[c], _mm512_set1_epi32(four_bytes(xg + 4 * c)));
        dots_high = _mm512_dpbusd_epi32(dots_high, high[c],
                                        _mm512_set1_epi32(four_bytes(xg + 16 + 4 * c)));
      }
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(dots_low, dots_high));
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(sums, _mm512_set1_ps(x.scales[at])), d, acc[m]);
      minimum_acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x.sums[at]), minimum_acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * kBlockRows, _mm512_add_ps(acc[m], minimum_acc[m]));
}
#endif

// The Ahead view for block b of a thread whose full blocks end at `stop`: none past it, and
// none for the padded tail (a copy, already in cache).
Ahead ahead_of(const Blocks& blocks, int64_t b, BlockView stop) {
  if (blocks.padded(b)) return {};
  const BlockView block = blocks[b];
  const int64_t distance = prefetch_plan().distance;
  const char* codes = reinterpret_cast<const char*>(block.codes) + distance;
  const int64_t code_bytes = blocks.groups() * kBlockGroupBytes;
  if (codes + code_bytes > reinterpret_cast<const char*>(stop.codes)) return {};
  // A group's params are a quarter of its code bytes (32 halves against 256 bytes), so the
  // same number of blocks ahead is distance / 4 bytes of params.
  return {codes, reinterpret_cast<const char*>(block.params) + distance / 4};
}

// Every activation row against each block while it is in L1: the weights stream from
// memory once per call whatever the row count. dots(r, take, block, ahead, out) computes
// rows [r, r + take) against one block into out[i * 16 + lane], asking for the lines
// `ahead` names as it goes (the first rows only: later ones find the block in L1).
template <typename scalar_t, typename Dots>
void for_each_block(const Blocks& blocks, int64_t rows, int64_t outs, scalar_t* out,
                    const Dots& dots) {
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    float results[kRowBlock * kBlockRows];
    const BlockView stop = blocks.stream_end(end);
    for (int64_t b = begin; b < end; ++b) {
      const BlockView block = blocks[b];
      const Ahead ahead = ahead_of(blocks, b, stop);
      const int64_t n0 = b * kBlockRows, count = blocks.rows(b);
      for (int64_t r = 0; r < rows; r += kRowBlock) {
        const int64_t take = std::min(kRowBlock, rows - r);
        dots(r, take, block, r == 0 ? ahead : Ahead{}, results);
        for (int64_t i = 0; i < take; ++i) {
          for (int64_t n = 0; n < count; ++n) out[(r + i) * outs + n0 + n] = results[i * kBlockRows + n];
        }
      }
    }
  });
}

template <typename scalar_t>
void integer_rows(const scalar_t* x, int64_t rows, int64_t in, int64_t outs, const Blocks& blocks,
                  scalar_t* out) {
#ifdef KVSERVE_AVX2
  const QuantizedRows xq = quantize_rows(x, rows, in);
#ifdef KVSERVE_HAVE_VNNI_KERNEL
  if (int8_vnni_supported()) {
    for_each_block(blocks, rows, outs, out, [&](int64_t r, int64_t take, BlockView block, Ahead ahead,
                                                   float* dots) {
      switch (take) {
        case 4: block_dots_vnni<4>(xq, r, block, ahead, dots); break;
        case 3: block_dots_vnni<3>(xq, r, block, ahead, dots); break;
        case 2: block_dots_vnni<2>(xq, r, block, ahead, dots); break;
        default: block_dots_vnni<1>(xq, r, block, ahead, dots); break;
      }
    });
    return;
  }
#endif
  for_each_block(blocks, rows, outs, out, [&](int64_t r, int64_t take, BlockView block, Ahead ahead,
                                                 float* dots) {
    switch (take) {
      case 4: block_dots_avx2<4>(xq, r, block, ahead, dots); break;
      case 3: block_dots_avx2<3>(xq, r, block, ahead, dots); break;
      case 2: block_dots_avx2<2>(xq, r, block, ahead, dots); break;
      default: block_dots_avx2<1>(xq, r, block, ahead, dots); break;
    }
  });
#else
  TORCH_CHECK(false, "the integer int4 path needs AVX2");
#endif
}

// A block's weights as floats, k-major: tile[k * 16 + lane] = d * q + m of the block's row
// `lane` at input channel k (rows past the block's end are zero weights).
void dequantize_block(BlockView block, int64_t groups, float* tile) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = block.codes + g * kBlockGroupBytes;
    const at::Half* params = block.params + g * kBlockGroupParams;
    float* dst = tile + g * kGroup * kBlockRows;
#ifdef KVSERVE_AVX2
    // A 32-bit lane of a chunk is one row's four bytes: shifting by 8b (+4) and masking
    // leaves that row's code of element 4c + b (+16) in the lane, already row-ordered.
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    for (int half = 0; half < 2; ++half) {
      const __m256 d = load8(params + 8 * half);
      const __m256 minimum = load8(params + kBlockRows + 8 * half);
      for (int c = 0; c < kChunks; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c + 32 * half));
        for (int b = 0; b < 4; ++b) {
          const __m256i low = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * b), nibble);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * b + 4), nibble);
          _mm256_storeu_ps(dst + (4 * c + b) * kBlockRows + 8 * half,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), d, minimum));
          _mm256_storeu_ps(dst + (16 + 4 * c + b) * kBlockRows + 8 * half,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), d, minimum));
        }
      }
    }
#else
    for (int64_t c = 0; c < kChunks; ++c) {
      for (int64_t lane = 0; lane < kBlockRows; ++lane) {
        const float d = half_to_float(params[lane]);
        const float minimum = half_to_float(params[kBlockRows + lane]);
        for (int64_t b = 0; b < 4; ++b) {
          const uint8_t byte = codes[64 * c + 4 * lane + b];
          dst[(4 * c + b) * kBlockRows + lane] = static_cast<float>(byte & 0x0F) * d + minimum;
          dst[(16 + 4 * c + b) * kBlockRows + lane] = static_cast<float>(byte >> 4) * d + minimum;
        }
      }
    }
#endif
  }
}

// MR activation rows (row stride ldx) against a k-major block tile: MR x 16 accumulators,
// one broadcast activation and two weight vectors per input channel; no horizontal sums.
#ifdef KVSERVE_AVX2
template <int MR>
void tile_rows(const float* x, int64_t ldx, const float* tile, int64_t in, float* out) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in; ++k) {
    const __m256 w0 = _mm256_loadu_ps(tile + k * kBlockRows);
    const __m256 w1 = _mm256_loadu_ps(tile + k * kBlockRows + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * kBlockRows, acc[m][0]);
    _mm256_storeu_ps(out + m * kBlockRows + 8, acc[m][1]);
  }
}
#endif

// MR rows of x against the tile into out[m * 16 + lane].
void tile_block(const float* x, int64_t rows, int64_t in, const float* tile, float* out) {
#ifdef KVSERVE_AVX2
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) tile_rows<4>(x + r * in, in, tile, in, out + r * kBlockRows);
  for (; r < rows; ++r) tile_rows<1>(x + r * in, in, tile, in, out + r * kBlockRows);
#else
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t lane = 0; lane < kBlockRows; ++lane) {
      float acc = 0.f;
      for (int64_t k = 0; k < in; ++k) acc += x[r * in + k] * tile[k * kBlockRows + lane];
      out[r * kBlockRows + lane] = acc;
    }
  }
#endif
}

// Rows taken per pass over a dequantized block (their results are staged 16 wide).
constexpr int64_t kTileRowsPerPass = 64;

void tiled_rows(const float* x, int64_t rows, int64_t in, int64_t outs, const Blocks& blocks,
                float* out) {
  const int64_t groups = in / kGroup;
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(in * kBlockRows);
    std::vector<float> staged(kTileRowsPerPass * kBlockRows);
    for (int64_t b = begin; b < end; ++b) {
      dequantize_block(blocks[b], groups, tile.data());
      const int64_t n0 = b * kBlockRows, count = blocks.rows(b);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRowsPerPass) {
        const int64_t take = std::min(kTileRowsPerPass, rows - r0);
        tile_block(x + r0 * in, take, in, tile.data(), staged.data());
        for (int64_t i = 0; i < take; ++i) {
          std::copy(staged.data() + i * kBlockRows, staged.data() + i * kBlockRows + count,
                    out + (r0 + i) * outs + n0);
        }
      }
    }
  });
}

}  // namespace

// out = x @ W.T for x [rows, in] and out [rows, out] both float32 or both bfloat16 (a bf16
// model's decode rows are quantized straight from bf16; the many-row path computes in
// float32 and converts at its ends). qweight and params: the interleaved layout, flat.
void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& params) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(qweight, "qweight");
  check_cpu_contiguous(params, "params");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and out must both be float32 or both bfloat16");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "qweight must be uint8");
  TORCH_CHECK(params.scalar_type() == at::kHalf, "params must be float16");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x and out must be 2-D");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = out.size(1);
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup);
  TORCH_CHECK(qweight.numel() == outs * in / 2, "qweight must hold out * in / 2 bytes");
  TORCH_CHECK(params.numel() == outs * (in / kGroup) * 2, "params must hold out * in / 32 * 2 values");
  TORCH_CHECK(out.size(0) == rows, "out must be [rows, out]");
  if (rows == 0 || outs == 0) return;
  const Blocks blocks(qweight.data_ptr<uint8_t>(), params.data_ptr<at::Half>(), outs, in);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  bool integer = rows <= kIntegerMaxRows;
#ifndef KVSERVE_AVX2
  integer = false;
#endif
  if (integer && bf16) {
    integer_rows(x.data_ptr<at::BFloat16>(), rows, in, outs, blocks, out.data_ptr<at::BFloat16>());
  } else if (integer) {
    integer_rows(x.data_ptr<float>(), rows, in, outs, blocks, out.data_ptr<float>());
  } else if (bf16) {
    const at::Tensor x32 = x.to(at::kFloat);
    at::Tensor out32 = at::empty({rows, outs}, x32.options());
    tiled_rows(x32.data_ptr<float>(), rows, in, outs, blocks, out32.data_ptr<float>());
    out.copy_(out32);
  } else {
    tiled_rows(x.data_ptr<float>(), rows, in, outs, blocks, out.data_ptr<float>());
  }
}

}  // namespace kvserve
