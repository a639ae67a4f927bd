// Registers the kvserve CPU ops with the dispatcher: torch.ops.kvserve.<name>.

#include <torch/library.h>

#include "moe.h"
#include "ops.h"

TORCH_LIBRARY(kvserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int num_rotated_heads, "
      "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor qkv, Tensor slots, "
      "int num_heads, int num_kv_heads, int head_dim) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor qkv, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, float scale, "
      "Tensor? key_scale=None, Tensor? value_scale=None, int window=0, float softcap=0.0, "
      "Tensor? sinks=None) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor qkv, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_starts, Tensor num_computed, int num_heads, "
      "int num_kv_heads, float scale, Tensor? key_scale=None, Tensor? value_scale=None, "
      "int window=0, float softcap=0.0, Tensor? sinks=None) -> ()");
  m.def("int8_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor scales) -> ()");
  m.def("int4_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor params) -> ()");
  m.def("int8_linear_vnni(Tensor(a!) out, Tensor x, Tensor weight, Tensor scales) -> ()");
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def("bf16_linear_amx(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def("f32_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor row_slots, Tensor spans)"
      " -> ()");
  // No tensor argument, so no dispatch key: one implementation for every backend.
  m.def("bf16_linear_supported() -> bool", &kvserve::bf16_linear_supported);
  m.def("f32_linear_supported() -> bool", &kvserve::f32_linear_supported);
  m.def("int8_vnni_supported() -> bool", &kvserve::int8_vnni_supported);
  m.def("int8_integer_supported() -> bool", &kvserve::int8_integer_supported);
  m.def("amx_available() -> bool", &kvserve::amx_available);
  m.def(
      "apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, int[] rows, int[] mask_rows, "
      "int vocab_size) -> ()");
  m.class_<kvserve::MoEWeights>("MoEWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, at::Tensor,
                       int64_t, int64_t, int64_t, bool, int64_t, double, double>());
  m.class_<kvserve::MoELayers>("MoELayers")
      .def(torch::init<int64_t>())
      .def("set", &kvserve::MoELayers::set);
  m.def(
      "moe_forward(Tensor(a!) out, Tensor x, __torch__.torch.classes.kvserve.MoEWeights weights) "
      "-> ()");
  // After MoELayers, which its schema names.
  m.def(
      "decode_layers(Tensor(a!) residual, Tensor[] weights, int[] kinds, Tensor[] qk_norms, "
      "__torch__.torch.classes.kvserve.MoELayers moe, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor positions, Tensor cos, Tensor sin, Tensor slots, "
      "Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale, float residual_multiplier) -> Tensor");
  m.def("copy_blocks_serial_(Tensor(a!) dst, Tensor src, int[] src_blocks, int[] dst_blocks) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("rms_norm", &kvserve::rms_norm);
  m.impl("add_rms_norm", &kvserve::add_rms_norm);
  m.impl("rotary_", &kvserve::rotary_);
  m.impl("silu_and_mul", &kvserve::silu_and_mul);
  m.impl("argmax_rows", &kvserve::argmax_rows);
  m.impl("write_kv", &kvserve::write_kv);
  m.impl("paged_decode_attention", &kvserve::paged_decode_attention);
  m.impl("paged_prefill_attention", &kvserve::paged_prefill_attention);
  m.impl("int8_linear", &kvserve::int8_linear);
  m.impl("int8_linear_vnni", &kvserve::int8_linear_vnni);
  m.impl("int4_linear", &kvserve::int4_linear);
  m.impl("bf16_linear", &kvserve::bf16_linear);
  m.impl("bf16_linear_amx", &kvserve::bf16_linear_amx);
  m.impl("f32_linear", &kvserve::f32_linear);
  m.impl("lora_apply", &kvserve::lora_apply);
  m.impl("apply_token_bitmask_", &kvserve::apply_token_bitmask_);
  m.impl("copy_blocks_serial_", &kvserve::copy_blocks_serial_);
  m.impl("decode_layers", &kvserve::decode_layers);
  m.impl("moe_forward", &kvserve::moe_forward);
}
