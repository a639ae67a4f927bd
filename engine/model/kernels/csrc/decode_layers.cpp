// Every decoder layer of a CPU decode step in one call: the same kernels as DecoderModel's
// Python loop (engine/model/layers/decoder.py), in the same order, on the same dtypes, so
// the result is bit-identical; what goes away is ten trips through Python and torch's
// dispatcher per layer (~1.3 ms of a ~4 ms single-stream step on two cores). Layers with
// Qwen3's per-head QK RMSNorm take it too (layers/attention.py's normalize_qk, op for op),
// and so do mixture-of-experts layers (their feed-forward is moe_forward, moe.cpp, the op
// layers/moe.py calls for such a step) and Granite's scaled sublayer outputs.
//
// Each projection arrives as a kind and two tensors (engine/model/runtime/cpu_decode.py
// builds them once per model; projection.h runs them): the few-row kernel it takes, its
// weight, and its scales or Q4_1 parameters. Steps of a few decode rows only: every
// projection is then on its few-row kernel, and there is no prefill to attend.

#include <ATen/ATen.h>

#include <utility>

#include "common.h"
#include "ops.h"
#include "projection.h"

namespace kvserve {
namespace {

constexpr int64_t kTensorsPerLayer = 10;  // two norms, then (a, b) for four projections

// The outputs of one layer's projections and activations, allocated by the first layer
// and reused by every later one: a step's rows and the model's widths are the same in
// every layer, and ~200 allocations through the dispatcher were ~0.1 ms of a 5 ms step.
class Buffers {
 public:
  explicit Buffers(const at::Tensor& like) : like_(like) {}
  // A [rows, width] tensor of like's dtype for `slot`, the same one at every layer.
  at::Tensor& get(int slot, int64_t width) {
    at::Tensor& buffer = slots_[slot];
    if (!buffer.defined() || buffer.size(1) != width) {
      buffer = at::empty({like_.size(0), width}, like_.options());
    }
    return buffer;
  }
  at::Tensor& project(int slot, int64_t kind, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& b) {
    at::Tensor& out = get(slot, out_features(kind, x, a, b));
    kvserve::project(kind, x, a, b, out);
    return out;
  }

 private:
  const at::Tensor& like_;
  at::Tensor slots_[6];
};

enum Slot : int { kQkv, kAttended, kOutput, kGateUp, kActivated, kDown };

// RMSNorm each head of the query and key parts of qkv in place, the values untouched: the
// same reshape, copy and rms_norm kernel as layers/attention.py's normalize_qk (per head),
// so the same bits.
void normalize_qk_per_head(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                           int64_t q_size, int64_t kv_size, int64_t head_dim, double eps) {
  const int64_t tokens = qkv.size(0);
  const std::pair<int64_t, const at::Tensor*> parts[] = {{q_size, &q_norm}, {kv_size, &k_norm}};
  int64_t start = 0;
  for (const auto& [width, weight] : parts) {
    at::Tensor part = qkv.narrow(1, start, width);
    const at::Tensor heads = part.reshape({-1, head_dim}).contiguous();
    at::Tensor normed = at::empty_like(heads);
    rms_norm(normed, heads, *weight, eps);
    part.copy_(normed.view({tokens, width}));
    start += width;
  }
}

// Granite's residual multiplier on a sublayer's output before it joins the residual stream:
// DecoderModel._leave's `out * multiplier`, done in place. The factor is a 0-dim double
// tensor, as Python's float becomes: mul_(Scalar) would round it to bf16 first and give
// other bits. Undefined for no multiplier.
void scale_output(at::Tensor& output, const at::Tensor& factor) {
  if (factor.defined()) output.mul_(factor);
}

}  // namespace

// residual: the embedded tokens [rows, hidden], updated in place into the residual stream;
// returns the hidden states after the last layer (before the final norm), as
// DecoderModel.forward does. weights: per layer input_norm, post_norm, then (a, b) of qkv,
// o_proj, gate_up, down; kinds: per layer the four projections' kinds; qk_norms: per layer
// the per-head q_norm and k_norm, or empty for a model without QK-norm; moe: the layers
// whose feed-forward is a mixture of experts (their gate_up and down operands are unused);
// residual_multiplier: Granite's scale of each sublayer's output (1 for none). key_cache
// and value_cache: the whole pool, [layers, kv_heads, blocks, block_size, head_dim].
at::Tensor decode_layers(at::Tensor& residual, at::TensorList weights, at::IntArrayRef kinds,
                         at::TensorList qk_norms, const c10::intrusive_ptr<MoELayers>& moe,
                         at::Tensor& key_cache, at::Tensor& value_cache,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale,
                         double residual_multiplier) {
  const int64_t layers = key_cache.size(0);
  TORCH_CHECK(layers > 0 && value_cache.size(0) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer &&
                  static_cast<int64_t>(kinds.size()) == layers * 4,
              "decode_layers: weights, kinds and caches disagree on the layer count");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == layers * 2,
              "decode_layers: qk_norms must be empty or a (q_norm, k_norm) pair per layer");
  check_cpu_contiguous(residual, "residual");
  at::Tensor hidden = at::empty_like(residual);
  rms_norm(hidden, residual, weights[0], eps);
  Buffers buffers(residual);
  const at::Tensor factor = residual_multiplier == 1.0
                                ? at::Tensor()
                                : at::scalar_tensor(residual_multiplier, at::kDouble);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kTensorsPerLayer;
    const int64_t* kind = kinds.data() + layer * 4;
    if (layer > 0) add_rms_norm(hidden, residual, w[0], eps);
    at::Tensor& qkv = buffers.project(kQkv, kind[0], hidden, w[2], w[3]);
    if (!qk_norms.empty()) {
      normalize_qk_per_head(qkv, qk_norms[layer * 2], qk_norms[layer * 2 + 1],
                            num_heads * head_dim, num_kv_heads * head_dim, head_dim, eps);
    }
    rotary_(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    at::Tensor keys = key_cache.select(0, layer);  // [kv_heads, blocks, block_size, head_dim]
    at::Tensor values = value_cache.select(0, layer);
    write_kv(keys, values, qkv, slots, num_heads, num_kv_heads, head_dim);
    at::Tensor& attended = buffers.get(kAttended, num_heads * head_dim);
    paged_decode_attention(attended, qkv, keys, values, block_tables, context_lens, num_heads,
                           num_kv_heads, scale, std::nullopt, std::nullopt);
    hidden = buffers.project(kOutput, kind[1], attended, w[4], w[5]);
    scale_output(hidden, factor);
    add_rms_norm(hidden, residual, w[1], eps);
    if (const auto* experts = moe->find(layer)) {
      at::Tensor& mixed = buffers.get(kDown, hidden.size(1));
      moe_forward(mixed, hidden, *experts);
      hidden = mixed;
    } else {
      const at::Tensor& gate_up = buffers.project(kGateUp, kind[2], hidden, w[6], w[7]);
      at::Tensor& activated = buffers.get(kActivated, gate_up.size(1) / 2);
      silu_and_mul(activated, gate_up);
      hidden = buffers.project(kDown, kind[3], activated, w[8], w[9]);
    }
    scale_output(hidden, factor);
  }
  return residual.add_(hidden);
}

}  // namespace kvserve
