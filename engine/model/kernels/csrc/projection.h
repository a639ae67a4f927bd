// One projection y = x @ W.T (+ bias) on the kernel a Python Linear layer would take for the
// same rows (engine/model/layers/linear.py), for the native paths that run several
// projections without returning to Python (decode_layers.cpp, moe.cpp). Each arrives as a
// kind and two tensors (engine/model/runtime/cpu_decode.py's LinearKind and
// projection_operands): its weight, and its scales or Q4_1 parameters.
#pragma once

#include <ATen/ATen.h>

#include "ops.h"

namespace kvserve {

// Must match LinearKind in engine/model/runtime/cpu_decode.py.
enum LinearKind : int64_t {
  kDense = 0,        // at::linear (a float32 or float16 model's projections)
  kDenseBf16 = 1,    // bf16_linear: a bf16 model on a CPU with AVX512_BF16
  kInt8Integer = 2,  // int8_linear_vnni (VNNI or AVX2): weight, per-row scales
  kInt8Float = 3,    // int8_linear on float32 activations: weight, per-row scales
  kInt4 = 4,         // int4_linear: packed codes, (scale, minimum) params
  kDenseF32 = 5,     // f32_linear: a float32 MoE's experts on a CPU with AVX2 + FMA
  kUnused = -1,      // decode_layers: no projection (an MoE layer's gate_up and down)
};

// Rows up to which a layer takes its few-row kernel: linear.py's BF16_ROWWISE_MAX_ROWS,
// F32_ROWWISE_MAX_ROWS and ROWWISE_MAX_ROWS (int8: past it Python goes to fbgemm, which no
// native path calls).
constexpr int64_t kBf16FewRows = 48;
constexpr int64_t kF32FewRows = 16;
constexpr int64_t kInt8FewRows = 4;

// Output features of a projection: a weight's rows, or for int4 the Q4_1 params' count
// (out * in / 32 (scale, minimum) pairs) over the input's width.
inline int64_t out_features(int64_t kind, const at::Tensor& x, const at::Tensor& a,
                            const at::Tensor& b) {
  return kind == kInt4 ? b.numel() * 16 / x.size(1) : a.size(0);
}

// out = x @ W.T (+ bias, when defined), as the Linear layer computes it for x's rows.
// out: [rows, out_features], x's dtype.
inline void project(int64_t kind, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    at::Tensor& out, const at::Tensor& bias = at::Tensor()) {
  const int64_t rows = x.size(0);
  const bool biased = bias.defined() && bias.numel() > 0;
  switch (kind) {
    case kDenseBf16:
      if (rows <= kBf16FewRows && x.scalar_type() == at::kBFloat16) {
        bf16_linear(out, x, a);
        break;
      }
      [[fallthrough]];
    case kDenseF32:
      if (kind == kDenseF32 && rows <= kF32FewRows && x.scalar_type() == at::kFloat) {
        f32_linear(out, x, a);
        break;
      }
      [[fallthrough]];
    case kDense:  // F.linear(x, w, b): the bias inside the GEMM, as Python's DenseLinear
      if (biased) {
        out.copy_(at::linear(x, a, bias));
      } else {
        at::linear_out(out, x, a);
      }
      return;
    case kInt8Integer:
      TORCH_CHECK(rows <= kInt8FewRows, "int8 few-row kernel: at most ", kInt8FewRows, " rows");
      int8_linear_vnni(out, x, a, b);
      break;
    case kInt8Float: {
      TORCH_CHECK(rows <= kInt8FewRows, "int8 few-row kernel: at most ", kInt8FewRows, " rows");
      if (x.scalar_type() == at::kFloat) {
        int8_linear(out, x, a, b);
        break;
      }
      at::Tensor out32 = at::empty(out.sizes(), out.options().dtype(at::kFloat));
      int8_linear(out32, x.to(at::kFloat), a, b);
      out.copy_(out32);
      break;
    }
    case kInt4:
      int4_linear(out, x, a, b);
      break;
    default:
      TORCH_CHECK(false, "unknown projection kind ", kind);
  }
  if (biased) out.add_(bias);  // after the kernel, as Int8Linear / Int4Linear add theirs
}

}  // namespace kvserve
