// One mixture-of-experts layer's weights as moe_forward takes them (moe.cpp): built once per
// layer from Python (torch.classes.kvserve.MoEWeights, engine/model/runtime/cpu_moe.py), so
// a step passes one object instead of six tensors per expert (each tensor of a list costs
// ~0.2 us to convert: ~150 us a layer at 128 experts).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <vector>

namespace kvserve {

struct MoEWeights : torch::CustomClassHolder {
  // Per expert: gate-up (a, b, bias), down (a, b, bias); an empty bias means none.
  std::vector<at::Tensor> experts;
  std::vector<int64_t> kinds;  // per expert: the two projections' LinearKind (projection.h)
  at::Tensor router_weight;    // [experts, hidden]
  at::Tensor router_bias;      // [experts], or empty
  int64_t router_kind;         // kDense, kDenseBf16 or kDenseF32
  int64_t top_k;
  int64_t rule;         // 0: softmax then top-k (renormalized if asked); 1: top-k then softmax
  bool renormalize;
  int64_t activation;   // 0: SiLU; 1: gpt-oss's clamped SwiGLU (alpha, limit)
  double alpha;
  double limit;

  MoEWeights(std::vector<at::Tensor> experts, std::vector<int64_t> kinds, at::Tensor router_weight,
             at::Tensor router_bias, int64_t router_kind, int64_t top_k, int64_t rule,
             bool renormalize, int64_t activation, double alpha, double limit);
};

// Which decoder layers are mixtures of experts, for decode_layers.cpp: built once per model
// (engine/model/runtime/cpu_decode.py), one set() per MoE layer; the other layers hold none.
struct MoELayers : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<MoEWeights>> layers;  // null where the layer is dense

  explicit MoELayers(int64_t count) : layers(count) {}
  void set(int64_t layer, c10::intrusive_ptr<MoEWeights> weights);
  // The layer's experts, or null for a dense layer.
  const c10::intrusive_ptr<MoEWeights>* find(int64_t layer) const;
};

// out = sum over each token's top_k experts of weight * expert(x[token]), router included.
void moe_forward(at::Tensor& out, const at::Tensor& x, const c10::intrusive_ptr<MoEWeights>& w);

}  // namespace kvserve
