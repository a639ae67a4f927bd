// bf16 linear on AMX tiles (Sapphire Rapids and later): out = x @ W.T for bf16 activations
// x [rows, in] and bf16 weights W [out, in] as the model stores them, float32 sums, bf16 out.
// A decode step of 32 sequences is 32 rows against every weight: too many products for
// vdpbf16ps to keep up with the weight stream (~2 flops a weight byte per row), and
// torch's GEMM (oneDNN) re-lays the weights out on every call. One tdpbf16ps does 16x the
// products of a vdpbf16ps, so here the weights stream at memory speed up to 32 rows and
// beyond.
//
// The weights are the tiles' left operand as they lie in memory, no repacked copy: a tile
// is 16 weight rows x 32 input features, loaded with the weight's row stride. The
// activations are the right operand, packed once per call into pairs: tile (step s,
// column block j) row p holds (x[m][32s + 2p], x[m][32s + 2p + 1]) for the 16 activation
// rows m of block j (rows past x's are zeros). A product thus gives out^T, 16 output
// features x 16 activation rows in float32; it is transposed back as it is rounded to
// bf16 and stored.
//
// Blocks of 32 output features (two weight tiles) against 32 activation rows (two
// activation tiles) make 2x2 products per 32-feature step: each weight tile feeds two
// products, the tiles read once for every 32 rows. Each thread walks a contiguous range of
// blocks; the hardware prefetcher follows the weight rows well enough (software prefetch
// 16-64 KiB ahead into L1 or L2 measured slower). A row's sums do not depend on the other
// rows of the call: the same products in the same order whatever the batch (but not the
// few-row kernel's order).

#include <ATen/Parallel.h>

#include <algorithm>

#include "amx_tiles.h"
#include "common.h"
#include "ops.h"

namespace kvserve {

#ifdef KVSERVE_HAVE_AMX
namespace {

constexpr int64_t kFeatures = 16;  // output features per weight tile
constexpr int64_t kRowsPerTile = 16;  // activation rows per activation tile
constexpr int64_t kStep = 32;      // input features per tile product
constexpr int64_t kTileDwords = 256;

struct Problem {
  uint16_t* out;
  const uint16_t* weight;
  const uint32_t* packed;  // [steps][column blocks][16 pairs][16 rows]
  int64_t rows, in, outs;
  int64_t steps, column_blocks;
};

// x's rows as the right operand (the layout above): 16 rows x 16 pairs at a time, read
// as dwords and transposed.
KVSERVE_AMX_TARGET void pack_activations(const uint16_t* x, const Problem& p, uint32_t* dst) {
  __m512i r[16];
  for (int64_t j = 0; j < p.column_blocks; ++j) {
    for (int64_t s = 0; s < p.steps; ++s) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t m = j * kRowsPerTile + i;
        r[i] = m < p.rows ? _mm512_loadu_si512(x + m * p.in + s * kStep) : _mm512_setzero_si512();
      }
      amx::transpose_16x16(r);
      uint32_t* tile = dst + (s * p.column_blocks + j) * kTileDwords;
      for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * 16, r[i]);
    }
  }
}

// Sixteen float32 -> bf16, rounded as bf16_linear.cpp's to_bf16 (nearest even, a NaN kept
// and made quiet).
KVSERVE_AMX_TARGET inline __m256i to_bf16x16(__m512i bits) {
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  const __m512i halves =
      _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(halves);
}

// One 16x16 float32 product (features x activation rows) into out[row][feature].
KVSERVE_AMX_TARGET void store_transposed(const Problem& p, const float* sums, int64_t feature,
                                         int64_t first_row) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums + i * 16);
  amx::transpose_16x16(r);
  const int64_t count = std::min<int64_t>(kRowsPerTile, p.rows - first_row);
  for (int64_t m = 0; m < count; ++m) {
    uint16_t* dst = p.out + (first_row + m) * p.outs + feature;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(r[m]));
  }
}

// H weight tiles (16 or 32 features from `feature`) x C activation tiles (16 or 32 rows
// from column block j): tiles 0-3 the sums, 4-5 the weights, 6-7 the activations.
template <int H, int C>
KVSERVE_AMX_TARGET void product_block(const Problem& p, int64_t feature, int64_t j,
                                      float sums[4][256]) {
  _tile_zero(0);
  if (C == 2) _tile_zero(1);
  if (H == 2) _tile_zero(2);
  if (H == 2 && C == 2) _tile_zero(3);
  const uint16_t* w = p.weight + feature * p.in;
  const int64_t stride = p.in * 2;
  for (int64_t s = 0; s < p.steps; ++s) {
    _tile_loadd(4, w + s * kStep, stride);
    if (H == 2) _tile_loadd(5, w + kFeatures * p.in + s * kStep, stride);
    const uint32_t* b = p.packed + (s * p.column_blocks + j) * kTileDwords;
    _tile_loadd(6, b, 64);
    if (C == 2) _tile_loadd(7, b + kTileDwords, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (C == 2) _tile_dpbf16ps(1, 4, 7);
    if (H == 2) _tile_dpbf16ps(2, 5, 6);
    if (H == 2 && C == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums[0], 64);
  if (C == 2) _tile_stored(1, sums[1], 64);
  if (H == 2) _tile_stored(2, sums[2], 64);
  if (H == 2 && C == 2) _tile_stored(3, sums[3], 64);
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) {
      store_transposed(p, sums[h * 2 + c], feature + h * kFeatures, (j + c) * kRowsPerTile);
    }
  }
}

template <int H>
KVSERVE_AMX_TARGET void feature_block(const Problem& p, int64_t feature, float sums[4][256]) {
  for (int64_t j = 0; j < p.column_blocks; j += 2) {
    if (j + 1 < p.column_blocks) {
      product_block<H, 2>(p, feature, j, sums);
    } else {
      product_block<H, 1>(p, feature, j, sums);
    }
  }
}

// Feature blocks [begin, end) of 32 (the last may be 16), on this thread's tiles.
KVSERVE_AMX_TARGET void run_blocks(const Problem& p, int64_t begin, int64_t end) {
  alignas(64) float sums[4][256];
  amx::configure_tiles();
  for (int64_t block = begin; block < end; ++block) {
    const int64_t feature = block * 2 * kFeatures;
    if (feature + 2 * kFeatures <= p.outs) {
      feature_block<2>(p, feature, sums);
    } else {
      feature_block<1>(p, feature, sums);
    }
  }
  amx::release_tiles();
}

}  // namespace
#endif

void bf16_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_available(),
              "bf16_linear_amx needs a CPU with AMX-BF16 (and KVSERVE_CPU_ISA unset)");
  check_bf16_linear(out, x, weight, "bf16_linear_amx");
  const int64_t rows = x.size(0);
  const int64_t in = x.size(1);
  const int64_t outs = weight.size(0);
  TORCH_CHECK(in % 32 == 0 && outs % 16 == 0,
              "bf16_linear_amx needs in_features % 32 == 0 and out_features % 16 == 0");
#ifdef KVSERVE_HAVE_AMX
  if (rows == 0) return;
  const int64_t column_blocks = (rows + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t steps = in / kStep;
  at::Tensor packed = at::empty({steps * column_blocks * kTileDwords}, x.options().dtype(at::kInt));
  Problem p{reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
            rows, in, outs, steps, column_blocks};
  pack_activations(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), p,
                   reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()));
  at::parallel_for(0, (outs + 31) / 32, 4, [&](int64_t begin, int64_t end) {
    run_blocks(p, begin, end);
  });
#endif
}

}  // namespace kvserve
