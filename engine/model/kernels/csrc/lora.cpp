// Batched LoRA on the CPU: y[r] += (x[r] @ A[s].T) @ Bt[s] for each row r with adapter slot
// s = row_slots[r] (rows with -1 run the base alone and are not touched). One call per
// projection applies every adapter of the step (engine/model/layers/lora.py).
//
// The rows are grouped by slot, and each weight load feeds a group of up to kGroup rows of
// that slot: a decode step of 32 rows over 4 adapters reads each adapter's A and B a few
// times per call instead of once per row, and does a quarter of the multiply-adds of
// stacking every slot and masking (no small GEMM calls, whose fixed cost dominated).
//
// A slot's Bt holds one block of rank rows per part (q, k, v of a fused QKV; gate, up of a
// fused MLP), and a part's block is zero outside that part's output columns. `spans` gives
// each part's non-zero columns [begin, end), so the expand reads only the blocks that reach
// a column tile: a third of a QKV slot's Bt, half a gate/up slot's. A part with no columns
// (one the adapter does not train) skips its shrink too.
//
// Accumulation is in float32 with every row's sums in a fixed order (the row group only
// shares loads), so a row's result does not depend on the other rows of the step.

#include <atomic>
#include <cstring>
#include <initializer_list>
#include <thread>
#include <type_traits>
#include <vector>

#include "bf16_dot.h"
#include "common.h"
#include "ops.h"

namespace kvserve {
namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;    // floats per vector
constexpr int kTileVecs = 4;  // vectors per expand column tile: 64 columns
#else
constexpr int kLanes = 8;
constexpr int kTileVecs = 2;
#endif
constexpr int kTile = kLanes * kTileVecs;
// Rows sharing each weight load: kGroup * kTileVecs accumulators plus kTileVecs weights
// stay in registers (20 of 32 zmm, 12 of 16 ymm).
constexpr int kGroup = 4;

// GCC/Clang vector extensions: the compiler emits the widest vectors the build enables.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Vec16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Vec32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// A spin-wait's pause: yields the core's pipeline to the other hyperthread, saves power.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// The element type the kernel reads a tensor of dtype T as (bf16: its raw bits).
template <typename T>
struct Stored {
  using type = T;
};
template <>
struct Stored<at::BFloat16> {
  using type = uint16_t;
};

// kLanes weights as floats. bf16 is the top half of a float32: widening is a shift.
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline Vec load(const uint16_t* p) {
  // GCC splits __builtin_convertvector's widening into halves; the intrinsic is one op.
#ifdef __AVX512F__
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(bits);
  return (Vec)_mm512_slli_epi32(wide, 16);
#elif defined(KVSERVE_AVX2)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i wide = _mm256_cvtepu16_epi32(bits);
  return (Vec)_mm256_slli_epi32(wide, 16);
#else
  Vec16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (Vec)(__builtin_convertvector(bits, Vec32) << 16);
#endif
}
inline Vec load(const at::Half* p) {
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline Vec load(const double* p) {  // refused before dispatch; here so every dtype compiles
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

inline float widen(float v) { return v; }
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}
inline float widen(at::Half v) { return static_cast<float>(v); }
inline float widen(double v) { return static_cast<float>(v); }

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) {
  const at::BFloat16 rounded(v);  // round to nearest even, as torch does
  std::memcpy(dst, &rounded, sizeof(*dst));
}
inline void store(at::Half* dst, float v) { *dst = static_cast<at::Half>(v); }
inline void store(double* dst, float v) { *dst = v; }

// dst[0..kLanes) = dst + sum, rounded once to the stored type.
inline void add_store(float* dst, Vec sum) {
  const Vec v = load(dst) + sum;
  std::memcpy(dst, &v, sizeof(v));
}
inline void add_store(uint16_t* dst, Vec sum) {
  const Vec v = load(dst) + sum;
  Vec32 bits = (Vec32)v;
  // Round to nearest even (torch's float -> bf16); a NaN stays a (quiet) NaN.
  const Vec32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  bits = v != v ? (bits >> 16) | 0x40u : rounded;
  const Vec16 out = __builtin_convertvector(bits, Vec16);
  std::memcpy(dst, &out, sizeof(out));
}
template <typename W>
inline void add_store(W* dst, Vec sum) {
  for (int l = 0; l < kLanes; ++l) store(dst + l, widen(dst[l]) + sum[l]);
}

// The step's rows that take an adapter, grouped by slot: rows order[first[s]..first[s+1])
// take slot s, in row order.
struct SlotRows {
  std::vector<int64_t> order, first;

  SlotRows(const int64_t* slots, int64_t rows, int64_t num_slots) : first(num_slots + 1, 0) {
    for (int64_t r = 0; r < rows; ++r)
      if (slots[r] >= 0) ++first[slots[r] + 1];
    for (int64_t s = 0; s < num_slots; ++s) first[s + 1] += first[s];
    order.resize(first[num_slots]);
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t r = 0; r < rows; ++r)
      if (slots[r] >= 0) order[next[slots[r]]++] = r;
  }
};

// The sum of v's lanes, in a fixed order, in registers (a sum through memory, spilled to the
// stack, cost more than the dot product it ends).
inline float sum_lanes(Vec v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(KVSERVE_AVX2)
  const __m256 wide = (__m256)v;
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(wide), _mm256_extractf128_ps(wide, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
#else
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
#endif
}

// out[g] = x[g] . a for G float rows against one weight row of n elements: two chains of
// vector partial sums per row, their lanes, then the tail (a fixed order for any G).
template <int G, typename W>
inline void dot_group(const float* const* x, const W* a, int64_t n, float* out) {
  Vec acc[G][2] = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const Vec a0 = load(a + i), a1 = load(a + i + kLanes);
    for (int g = 0; g < G; ++g) {
      acc[g][0] += load(x[g] + i) * a0;
      acc[g][1] += load(x[g] + i + kLanes) * a1;
    }
  }
  for (int g = 0; g < G; ++g) {
    float tail = 0.0f;
    for (int64_t j = i; j < n; ++j) tail += x[g][j] * widen(a[j]);
    out[g] = sum_lanes(acc[g][0] + acc[g][1]) + tail;
  }
}

// The operands of one call, as the kernel reads them.
template <typename W>
struct LoRAOperands {
  W* y;
  const W* a;
  const W* bt;
  const int64_t* spans;  // [slots, parts, 2]
  int64_t in, out, width, parts, rank;

  const int64_t* span(int64_t slot, int64_t part) const {
    return spans + (slot * parts + part) * 2;
  }
  bool reaches(int64_t slot, int64_t part, int64_t begin, int64_t end) const {
    const int64_t* s = span(slot, part);
    return s[0] < s[1] && s[0] < end && begin < s[1];
  }
};

// shrunk[i, part's k] = xf[row i] . a[slot, k] for G consecutive rows i of one slot.
template <int G, typename W>
void shrink_group(const LoRAOperands<W>& op, const float* xf, const SlotRows& rows, int64_t i,
                  int64_t slot, int64_t part, float* shrunk) {
  const float* x[G];
  for (int g = 0; g < G; ++g) x[g] = xf + rows.order[i + g] * op.in;
  float dots[G];
  for (int64_t k = part * op.rank; k < (part + 1) * op.rank; ++k) {
    dot_group<G>(x, op.a + (slot * op.width + k) * op.in, op.in, dots);
    for (int g = 0; g < G; ++g) shrunk[(i + g) * op.width + k] = dots[g];
  }
}

#ifdef KVSERVE_HAVE_BF16_KERNEL
// The same with bf16 dot products (AVX512_BF16), on G rows gathered in slot order (row
// stride in): no widening of x or A, a third of the instructions of the float path.
template <int G>
KVSERVE_BF16_TARGET void shrink_group_bf16(const LoRAOperands<uint16_t>& op, const uint16_t* xg,
                                           int64_t i, int64_t slot, int64_t part, float* shrunk) {
  float dots[G];
  for (int64_t k = part * op.rank; k < (part + 1) * op.rank; ++k) {
    dot_rows_bf16<G>(xg + i * op.in, op.in, op.a + (slot * op.width + k) * op.in, op.in, dots);
    for (int g = 0; g < G; ++g) shrunk[(i + g) * op.width + k] = dots[g];
  }
}
#endif

// y[row i, columns c0 + V * kLanes) += shrunk[i] @ bt[slot, :, those columns] for G
// consecutive rows i of one slot, over every part that reaches the columns.
template <int G, int V, typename W>
void expand_group(const LoRAOperands<W>& op, const float* shrunk, const SlotRows& rows,
                  int64_t i, int64_t slot, int64_t c0) {
  Vec acc[G][V] = {};
  for (int64_t part = 0; part < op.parts; ++part) {
    if (!op.reaches(slot, part, c0, c0 + V * kLanes)) continue;
    for (int64_t k = part * op.rank; k < (part + 1) * op.rank; ++k) {
      const W* b = op.bt + (slot * op.width + k) * op.out + c0;
      Vec w[V];
      for (int v = 0; v < V; ++v) w[v] = load(b + v * kLanes);
      for (int g = 0; g < G; ++g) {
        const float s = shrunk[(i + g) * op.width + k];
        for (int v = 0; v < V; ++v) acc[g][v] += s * w[v];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v)
      add_store(op.y + rows.order[i + g] * op.out + c0 + v * kLanes, acc[g][v]);
}

// The same for the last columns [c0, out), fewer than kLanes: one column at a time.
template <typename W>
void expand_tail(const LoRAOperands<W>& op, const float* shrunk, const SlotRows& rows, int64_t i,
                 int64_t slot, int64_t c0) {
  W* y = op.y + rows.order[i] * op.out;
  for (int64_t c = c0; c < op.out; ++c) {
    float sum = 0.0f;
    for (int64_t part = 0; part < op.parts; ++part) {
      if (!op.reaches(slot, part, c, c + 1)) continue;
      for (int64_t k = part * op.rank; k < (part + 1) * op.rank; ++k)
        sum += shrunk[i * op.width + k] * widen(op.bt[(slot * op.width + k) * op.out + c]);
    }
    store(y + c, widen(y[c]) + sum);
  }
}

// Calls fn(std::integral_constant<int, G>{}, i) for the rows [begin, end) of a slot in
// groups of kGroup, then one smaller group.
template <typename Fn>
inline void for_each_group(int64_t begin, int64_t end, Fn&& fn) {
  int64_t i = begin;
  for (; i + kGroup <= end; i += kGroup) fn(std::integral_constant<int, kGroup>{}, i);
  switch (end - i) {
    case 3: fn(std::integral_constant<int, 3>{}, i); break;
    case 2: fn(std::integral_constant<int, 2>{}, i); break;
    case 1: fn(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}
static_assert(kGroup == 4, "for_each_group's remainders assume groups of four");

template <typename W>
void lora_rows(const LoRAOperands<W>& op, const W* x, const int64_t* slots, int64_t rows,
               int64_t num_slots) {
  const SlotRows grouped(slots, rows, num_slots);
  if (grouped.order.empty()) return;
  // The shrink's activations, once per call: gathered in slot order as bf16 for the bf16
  // dot products, else widened to float32 (not once per A row). The buffers belong to the
  // calling thread and are kept between calls (a fresh allocation of this size came back
  // from the OS each time, and its page faults cost more than the arithmetic); the workers
  // reach them through these pointers (by name, a thread_local would be the worker's own).
  thread_local std::vector<float> xf_buffer, shrunk_buffer;
  thread_local std::vector<uint16_t> xg_buffer;
  const auto active = static_cast<int64_t>(grouped.order.size());
  shrunk_buffer.resize(std::max<size_t>(shrunk_buffer.size(), active * op.width));
  float* const shrunk = shrunk_buffer.data();
  bool bf16_dots = false;
  if constexpr (std::is_same_v<W, uint16_t>) bf16_dots = bf16_linear_supported();
  const float* xf = nullptr;
  const uint16_t* xg = nullptr;
  if (bf16_dots) {
    xg_buffer.resize(std::max<size_t>(xg_buffer.size(), active * op.in));
    for (int64_t i = 0; i < active; ++i)
      std::memcpy(xg_buffer.data() + i * op.in, x + grouped.order[i] * op.in, op.in * sizeof(W));
    xg = xg_buffer.data();
  } else {
    xf_buffer.resize(std::max<size_t>(xf_buffer.size(), rows * op.in));
    for (int64_t r : grouped.order)
      for (int64_t j = 0; j < op.in; ++j) xf_buffer[r * op.in + j] = widen(x[r * op.in + j]);
    xf = xf_buffer.data();
  }

  // Shrink items: (slot, part) with rows and columns. Expand items: (slot, column tile)
  // that some part of the slot reaches.
  std::vector<std::pair<int64_t, int64_t>> shrinks, tiles;
  for (int64_t s = 0; s < num_slots; ++s) {
    if (grouped.first[s] == grouped.first[s + 1]) continue;
    for (int64_t p = 0; p < op.parts; ++p)
      if (op.reaches(s, p, 0, op.out)) shrinks.emplace_back(s, p);
    for (int64_t c0 = 0; c0 < op.out; c0 += kTile)
      for (int64_t p = 0; p < op.parts; ++p)
        if (op.reaches(s, p, c0, std::min(c0 + kTile, op.out))) {
          tiles.emplace_back(s, c0);
          break;
        }
  }
  auto shrink = [&](int64_t item) {
    const auto [slot, part] = shrinks[item];
    for_each_group(grouped.first[slot], grouped.first[slot + 1], [&](auto G, int64_t i) {
      constexpr int kRows = decltype(G)::value;
#ifdef KVSERVE_HAVE_BF16_KERNEL
      if constexpr (std::is_same_v<W, uint16_t>) {
        if (bf16_dots) return shrink_group_bf16<kRows>(op, xg, i, slot, part, shrunk);
      }
#endif
      shrink_group<kRows>(op, xf, grouped, i, slot, part, shrunk);
    });
  };
  auto expand = [&](int64_t item) {
    const auto [slot, c0] = tiles[item];
    for_each_group(grouped.first[slot], grouped.first[slot + 1], [&](auto G, int64_t i) {
      constexpr int kRows = decltype(G)::value;
      if (c0 + kTile <= op.out) {
        expand_group<kRows, kTileVecs>(op, shrunk, grouped, i, slot, c0);
        return;
      }
      int64_t c = c0;  // the last, partial tile: whole vectors, then single columns
      for (; c + kLanes <= op.out; c += kLanes)
        expand_group<kRows, 1>(op, shrunk, grouped, i, slot, c);
      for (int g = 0; g < kRows && c < op.out; ++g)
        expand_tail(op, shrunk, grouped, i + g, slot, c);
    });
  };
  // One parallel region, not one per phase (a fork and join cost as much as a small
  // projection's arithmetic). Worker w of W takes the w-th share of the shrink items, waits
  // until every worker has finished its share (the expand reads every part's shrunk rows),
  // then takes the w-th share of the expand items. Static shares, not a shared counter per
  // item: each item's atomic increment bounced a cache line between the cores. at::
  // parallel_for runs its chunks concurrently (a chunk may cover several workers, and run
  // inline it covers all), so the wait ends once every chunk has done its shrinks.
  const auto num_shrinks = static_cast<int64_t>(shrinks.size());
  const auto num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles));
  std::atomic<int64_t> shrunk_workers{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * num_shrinks / workers; i < end * num_shrinks / workers; ++i) shrink(i);
    shrunk_workers.fetch_add(end - begin, std::memory_order_acq_rel);
    while (shrunk_workers.load(std::memory_order_acquire) < workers) cpu_relax();
    for (int64_t i = begin * num_tiles / workers; i < end * num_tiles / workers; ++i) expand(i);
  });
}

}  // namespace

void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const at::Tensor& row_slots, const at::Tensor& spans) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&y, &x, &a, &bt, &row_slots, &spans})
    check_cpu_contiguous(*t, "lora operand");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(y.size(0) == rows && row_slots.numel() == rows, "one slot per row of x and y");
  TORCH_CHECK(a.size(1) == in && bt.size(1) == out && a.size(0) == bt.size(0),
              "a [slots * width, in] and bt [slots * width, out] stack the same slots");
  TORCH_CHECK(spans.dim() == 3 && spans.size(2) == 2 && spans.size(0) > 0 && spans.size(1) > 0,
              "spans is [slots, parts, 2]");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && spans.scalar_type() == at::kLong,
              "row_slots and spans must be int64");
  const int64_t num_slots = spans.size(0), parts = spans.size(1);
  TORCH_CHECK(a.size(0) % (num_slots * parts) == 0, "a's rows must be slots x parts x rank");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == a.scalar_type() &&
                  a.scalar_type() == bt.scalar_type(),
              "x, y, a and bt must share one dtype");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] < num_slots, "row slot ", slots[r], " past the ", num_slots, " slots");
  const int64_t* span = spans.data_ptr<int64_t>();
  for (int64_t i = 0; i < spans.numel(); i += 2)
    TORCH_CHECK(0 <= span[i] && span[i] <= span[i + 1] && span[i + 1] <= out,
                "a part's columns must lie within the output");
  TORCH_CHECK(x.scalar_type() != at::kDouble, "lora_apply takes float32, bfloat16 or float16");
  const int64_t width = a.size(0) / num_slots;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    using W = typename Stored<scalar_t>::type;
    const LoRAOperands<W> op{reinterpret_cast<W*>(y.data_ptr<scalar_t>()),
                             reinterpret_cast<const W*>(a.data_ptr<scalar_t>()),
                             reinterpret_cast<const W*>(bt.data_ptr<scalar_t>()),
                             span, in, out, width, parts, width / parts};
    lora_rows<W>(op, reinterpret_cast<const W*>(x.data_ptr<scalar_t>()), slots, rows, num_slots);
  });
}

}  // namespace kvserve
