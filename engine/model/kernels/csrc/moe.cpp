// A mixture-of-experts feed-forward for one step in one call: engine/model/layers/moe.py's
// router, routing rule and grouped expert loop without a trip through Python and the
// dispatcher for each op of each chosen expert (~10 per expert per layer). The same
// kernels and ATen calls in the same order, the same rounding points, so the result is
// bit-identical to the Python path's (tests/model/test_moe.py), with one exception: an
// int8 expert with more rows than its few-row kernel takes runs them four at a time here
// where Python hands them to fbgemm (moe.py only takes this path for decode-sized steps).
//
// The chosen experts whose projections run on kvserve's own kernels (few-row bf16, float32,
// int8, int4: each output computed whole by one thread, so the thread count never changes a
// result) run in parallel, one expert per thread at a time, largest first: a decode step's
// experts are small matrices, and one thread streaming a whole expert beats two threads
// meeting inside each of them (and an OpenMP fork per projection). Experts on an ATen GEMM
// (float16; float32 and bf16 past their few-row kernels, or without them) run after them
// one at a time with ATen's own threads, as Python runs them, since a GEMM's result may
// depend on how it is threaded. Their outputs are then added into each token's row in
// ascending expert id, as the Python loop adds them.
//
// Each expert arrives as six tensors -- gate-up (a, b, bias), down (a, b, bias); an empty
// bias means none -- and its two projections' kinds (projection.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "common.h"
#include "moe.h"
#include "ops.h"
#include "projection.h"

namespace kvserve {
namespace {

constexpr int64_t kTensorsPerExpert = 6;

// Must match engine/model/runtime/cpu_moe.py.
enum RoutingRule : int64_t { kSoftmaxTopk = 0, kTopkSoftmax = 1 };
enum ExpertActivation : int64_t {
  kSilu = 0,           // silu(gate) * up
  kClampedSwiglu = 1,  // gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
};

struct Routed {
  at::Tensor weights;  // [tokens, top_k] float32
  at::Tensor ids;      // [tokens, top_k] int64
};

// layers/moe.py's route(), op for op.
Routed route(const at::Tensor& logits, int64_t top_k, int64_t rule, bool renormalize) {
  if (rule == kTopkSoftmax) {
    auto [top, ids] = at::topk(logits, top_k, -1);
    return {at::softmax(top.to(at::kFloat), -1), ids};
  }
  auto [weights, ids] = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1);
  if (renormalize) weights = weights / weights.sum(-1, true);
  return {weights, ids};
}

// The (token, slot) pairs of each expert, in pair order: a counting sort, as stable as the
// Python path's argsort.
std::vector<std::vector<int64_t>> pairs_by_expert(const at::Tensor& ids, int64_t experts) {
  std::vector<std::vector<int64_t>> buckets(experts);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t pair = 0; pair < ids.numel(); ++pair) {
    TORCH_CHECK(id[pair] >= 0 && id[pair] < experts, "expert id ", id[pair], " out of range");
    buckets[id[pair]].push_back(pair);
  }
  return buckets;
}

// The rows of x the pairs' tokens hold, one after another.
at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& pairs, int64_t top_k) {
  const int64_t rows = static_cast<int64_t>(pairs.size());
  at::Tensor gathered = at::empty({rows, x.size(1)}, x.options());
  const int64_t row_bytes = x.size(1) * x.element_size();
  auto* src = static_cast<const char*>(x.data_ptr());
  auto* dst = static_cast<char*>(gathered.data_ptr());
  for (int64_t row = 0; row < rows; ++row) {
    std::memcpy(dst + row * row_bytes, src + (pairs[row] / top_k) * row_bytes, row_bytes);
  }
  return gathered;
}

// A projection of any number of rows; an int8 few-row kernel takes them four at a time.
void project_rows(int64_t kind, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                  at::Tensor& out, const at::Tensor& bias) {
  const bool int8 = kind == kInt8Integer || kind == kInt8Float;
  if (!int8 || x.size(0) <= kInt8FewRows) {
    project(kind, x, a, b, out, bias);
    return;
  }
  for (int64_t start = 0; start < x.size(0); start += kInt8FewRows) {
    const int64_t rows = std::min(kInt8FewRows, x.size(0) - start);
    at::Tensor part = out.narrow(0, start, rows);
    at::Tensor result = at::empty_like(part);
    project(kind, x.narrow(0, start, rows).contiguous(), a, b, result, bias);
    part.copy_(result);
  }
}

void activate(int64_t activation, const at::Tensor& fused, at::Tensor& out, double alpha,
              double limit) {
  if (activation == kSilu) {
    silu_and_mul(out, fused);
    return;
  }
  // The same ATen ops as layers/mlp.py's ClampedSwiGLU, so the same rounding.
  const int64_t width = out.size(1);
  at::Tensor gate = fused.narrow(1, 0, width).clamp_max(limit);
  at::Tensor up = fused.narrow(1, width, width).clamp(-limit, limit);
  out.copy_((up + 1) * (gate * at::sigmoid(gate * alpha)));
}

// Whether a projection of `rows` rows runs on an ATen GEMM (thread count matters) rather
// than one of kvserve's row-wise kernels.
bool on_aten_gemm(int64_t kind, int64_t rows) {
  return kind == kDense || (kind == kDenseBf16 && rows > kBf16FewRows) ||
         (kind == kDenseF32 && rows > kF32FewRows);
}

struct ExpertSpec {
  const at::Tensor* tensors;  // six
  const int64_t* kinds;       // two
  int64_t activation;
  double alpha;
  double limit;
};

// One expert over its rows: down(act(gate_up(x))), each with its bias.
at::Tensor run_expert(const ExpertSpec& e, const at::Tensor& x) {
  const at::Tensor* w = e.tensors;
  const int64_t rows = x.size(0);
  at::Tensor fused = at::empty({rows, out_features(e.kinds[0], x, w[0], w[1])}, x.options());
  project_rows(e.kinds[0], x, w[0], w[1], fused, w[2]);
  at::Tensor activated = at::empty({rows, fused.size(1) / 2}, x.options());
  activate(e.activation, fused, activated, e.alpha, e.limit);
  at::Tensor y = at::empty({rows, out_features(e.kinds[1], activated, w[3], w[4])}, x.options());
  project_rows(e.kinds[1], activated, w[3], w[4], y, w[5]);
  return y;
}

// o += cast(v * w) in the row's dtype. The product is rounded before the add, as torch's
// two ops round it: no fused multiply-add here.
template <typename scalar_t>
__attribute__((optimize("fp-contract=off"))) void add_weighted_row(scalar_t* o, const scalar_t* v,
                                                                    float w, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    const scalar_t weighted = static_cast<scalar_t>(static_cast<float>(v[h]) * w);
    o[h] = static_cast<scalar_t>(static_cast<float>(o[h]) + static_cast<float>(weighted));
  }
}

// out[token] += cast(y_e[row] * weight), expert after expert in ascending id. Tokens are
// independent, so they go in parallel; within a token the experts keep their order.
template <typename scalar_t>
void add_weighted(at::Tensor& out, const std::vector<at::Tensor>& outputs,
                  const std::vector<std::vector<int64_t>>& buckets, const at::Tensor& weights,
                  int64_t top_k) {
  const int64_t tokens = out.size(0);
  const int64_t hidden = out.size(1);
  // For each token, its (expert, row) pairs in ascending expert id.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows_of(tokens);
  std::vector<std::vector<float>> weight_of(tokens);
  const float* w = weights.data_ptr<float>();
  for (size_t e = 0; e < buckets.size(); ++e) {
    for (size_t row = 0; row < buckets[e].size(); ++row) {
      const int64_t pair = buckets[e][row];
      rows_of[pair / top_k].emplace_back(static_cast<int64_t>(e), static_cast<int64_t>(row));
      weight_of[pair / top_k].push_back(w[pair]);
    }
  }
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      for (size_t i = 0; i < rows_of[token].size(); ++i) {
        const auto [e, row] = rows_of[token][i];
        const scalar_t* y = outputs[e].data_ptr<scalar_t>() + row * hidden;
        add_weighted_row(op + token * hidden, y, weight_of[token][i], hidden);
      }
    }
  });
}

}  // namespace

MoEWeights::MoEWeights(std::vector<at::Tensor> experts, std::vector<int64_t> kinds,
                       at::Tensor router_weight, at::Tensor router_bias, int64_t router_kind,
                       int64_t top_k, int64_t rule, bool renormalize, int64_t activation,
                       double alpha, double limit)
    : experts(std::move(experts)),
      kinds(std::move(kinds)),
      router_weight(std::move(router_weight)),
      router_bias(std::move(router_bias)),
      router_kind(router_kind),
      top_k(top_k),
      rule(rule),
      renormalize(renormalize),
      activation(activation),
      alpha(alpha),
      limit(limit) {
  const auto num_experts = static_cast<int64_t>(this->experts.size()) / kTensorsPerExpert;
  TORCH_CHECK(num_experts > 0 &&
                  static_cast<int64_t>(this->experts.size()) == num_experts * kTensorsPerExpert &&
                  static_cast<int64_t>(this->kinds.size()) == num_experts * 2,
              "MoEWeights: six tensors and two kinds per expert");
  TORCH_CHECK(this->router_weight.size(0) == num_experts, "a router row per expert");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, experts]");
  TORCH_CHECK(rule == kSoftmaxTopk || rule == kTopkSoftmax, "unknown routing rule");
  TORCH_CHECK(activation == kSilu || activation == kClampedSwiglu, "unknown activation");
  TORCH_CHECK(router_kind == kDense || router_kind == kDenseBf16 || router_kind == kDenseF32,
              "the router is dense");
}

void MoELayers::set(int64_t layer, c10::intrusive_ptr<MoEWeights> weights) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers.size()), "MoELayers: layer ",
              layer, " out of range");
  layers[layer] = std::move(weights);
}

const c10::intrusive_ptr<MoEWeights>* MoELayers::find(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layers.size()) || !layers[layer]) return nullptr;
  return &layers[layer];
}

void moe_forward(at::Tensor& out, const at::Tensor& x, const c10::intrusive_ptr<MoEWeights>& w) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be like x");
  const at::TensorList experts(w->experts);
  const at::IntArrayRef kinds(w->kinds);
  const int64_t num_experts = static_cast<int64_t>(experts.size()) / kTensorsPerExpert;
  const int64_t top_k = w->top_k, activation = w->activation;
  const double alpha = w->alpha, limit = w->limit;
  const at::Tensor& router_weight = w->router_weight;
  at::Tensor logits = at::empty({x.size(0), router_weight.size(0)}, x.options());
  project(w->router_kind, x, router_weight, router_weight, logits, w->router_bias);
  const Routed routed = route(logits, top_k, w->rule, w->renormalize);
  const at::Tensor ids = routed.ids.contiguous();
  const at::Tensor weights = routed.weights.contiguous();
  const auto buckets = pairs_by_expert(ids, num_experts);

  std::vector<int64_t> row_wise, gemm;  // experts with tokens, by the kernels they take
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = static_cast<int64_t>(buckets[e].size());
    if (rows == 0) continue;
    const bool aten = on_aten_gemm(kinds[e * 2], rows) || on_aten_gemm(kinds[e * 2 + 1], rows);
    (aten ? gemm : row_wise).push_back(e);
  }
  std::stable_sort(row_wise.begin(), row_wise.end(), [&](int64_t a, int64_t b) {
    return buckets[a].size() > buckets[b].size();
  });
  std::vector<at::Tensor> outputs(num_experts);
  auto run = [&](int64_t e) {
    const ExpertSpec spec{experts.data() + e * kTensorsPerExpert, kinds.data() + e * 2,
                          activation, alpha, limit};
    outputs[e] = run_expert(spec, gather_rows(x, buckets[e], top_k));
  };
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), row_wise.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < static_cast<int64_t>(row_wise.size()); i = next++) {
      run(row_wise[i]);
    }
  });
  for (const int64_t e : gemm) run(e);
  out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_forward", [&] {
    add_weighted<scalar_t>(out, outputs, buckets, weights, top_k);
  });
}

}  // namespace kvserve
