// Batched LoRA on the CPU: y[r] += (x[r] @ A[s].T) @ Bt[s] for each row r with adapter slot
// s = row_slots[r] (rows with -1 run the base alone and are not touched). One call per
// projection applies every adapter of the step (engine/model/layers/lora.py).
//
// Each row reads only its own slot's A and B: a decode step of 32 rows over 4 adapters does
// a quarter of the multiply-adds of stacking every slot and masking, and none of the small
// GEMM calls whose fixed cost (~25 us each in oneDNN at these shapes) dominated. Rows are
// split across threads; a slot's A and B (tens to hundreds of KiB) stay in cache for the
// rows that share it. Accumulation is in float32, each row's sums in a fixed order, so a
// row's result does not depend on the other rows of the step.

#include <cstring>
#include <initializer_list>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvserve {
namespace {

// Four 16-float vectors of partial sums: independent FMA chains hide the FMA latency.
constexpr int kLanes = 64;

// A weight element as float. bf16 is the top half of a float32: widening the bits is the
// whole conversion, and written so the compiler vectorizes the loops that call it.
inline float widen(float v) { return v; }
inline float widen(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline float widen(at::Half v) { return static_cast<float>(v); }
inline float widen(double v) { return static_cast<float>(v); }  // refused before dispatch

// The element type the kernel reads a tensor of dtype T as.
template <typename T>
struct Stored {
  using type = T;
};
template <>
struct Stored<at::BFloat16> {
  using type = uint16_t;
};

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) {
  const at::BFloat16 rounded(v);  // round to nearest even, as torch does
  std::memcpy(dst, &rounded, sizeof(*dst));
}
inline void store(at::Half* dst, float v) { *dst = static_cast<at::Half>(v); }
inline void store(double* dst, float v) { *dst = v; }

// Sum of x[i] * w[i] in kLanes partial sums (so the compiler vectorizes the inner loop
// without reassociating), then the tail, then the lanes: a fixed order for every row.
template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * widen(w[i + l]);
  float sum = 0.0f;
  for (; i < n; ++i) sum += x[i] * widen(w[i]);
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// out[j] += sum over the 4 rows k of s[k] * b_k[j]: four B rows per pass over the
// accumulator, so it is loaded and stored a quarter as often.
template <typename W>
inline void axpy4(float* acc, const float* s, const W* b, int64_t stride, int64_t n) {
  const W *b0 = b, *b1 = b + stride, *b2 = b + 2 * stride, *b3 = b + 3 * stride;
  for (int64_t j = 0; j < n; ++j)
    acc[j] += s[0] * widen(b0[j]) + s[1] * widen(b1[j]) + s[2] * widen(b2[j]) +
              s[3] * widen(b3[j]);
}

template <typename W>
void lora_rows(W* y, const W* x, const W* a, const W* bt, const int64_t* slots, int64_t rows,
               int64_t in, int64_t out, int64_t width) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), shrunk(width + 3, 0.0f), acc(out);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = slots[r];
      if (slot < 0) continue;
      for (int64_t i = 0; i < in; ++i) xf[i] = widen(x[r * in + i]);
      for (int64_t k = 0; k < width; ++k)
        shrunk[k] = dot(xf.data(), a + (slot * width + k) * in, in);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const W* b = bt + slot * width * out;
      int64_t k = 0;
      for (; k + 4 <= width; k += 4) {
        // A whole group of zeros: a part the adapter does not train, or rank padding.
        if (shrunk[k] == 0.0f && shrunk[k + 1] == 0.0f && shrunk[k + 2] == 0.0f &&
            shrunk[k + 3] == 0.0f)
          continue;
        axpy4(acc.data(), shrunk.data() + k, b + k * out, out, out);
      }
      for (; k < width; ++k)
        for (int64_t j = 0; j < out; ++j) acc[j] += shrunk[k] * widen(b[k * out + j]);
      W* yr = y + r * out;
      for (int64_t j = 0; j < out; ++j) store(yr + j, widen(yr[j]) + acc[j]);
    }
  });
}

}  // namespace

void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const at::Tensor& row_slots, int64_t width) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&y, &x, &a, &bt, &row_slots})
    check_cpu_contiguous(*t, "lora operand");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(y.size(0) == rows && row_slots.numel() == rows, "one slot per row of x and y");
  TORCH_CHECK(a.size(1) == in && bt.size(1) == out && a.size(0) == bt.size(0),
              "a [slots * width, in] and bt [slots * width, out] stack the same slots");
  TORCH_CHECK(width > 0 && a.size(0) % width == 0, "width must divide the stacked rows");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong, "row_slots must be int64");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == a.scalar_type() &&
                  a.scalar_type() == bt.scalar_type(),
              "x, y, a and bt must share one dtype");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  const int64_t num_slots = a.size(0) / width;
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] < num_slots, "row slot ", slots[r], " past the ", num_slots, " slots");
  TORCH_CHECK(x.scalar_type() != at::kDouble, "lora_apply takes float32, bfloat16 or float16");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    using W = typename Stored<scalar_t>::type;
    lora_rows<W>(reinterpret_cast<W*>(y.data_ptr<scalar_t>()),
                 reinterpret_cast<const W*>(x.data_ptr<scalar_t>()),
                 reinterpret_cast<const W*>(a.data_ptr<scalar_t>()),
                 reinterpret_cast<const W*>(bt.data_ptr<scalar_t>()), slots, rows, in, out, width);
  });
}

}  // namespace kvserve
