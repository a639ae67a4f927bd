// The kvserve CPU ops, registered as torch.ops.kvserve.* in register.cpp.
//
// Layouts are the ones engine/model/kv_cache.py documents: one layer's cache is
// [kv_heads, num_blocks, block_size, head_dim], contiguous; qkv rows are the fused
// projection output, queries then keys then values. Numerics follow the torch backend in
// engine/model/kernels.py: float32 accumulation, rounding to the tensor dtype at the same
// points.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "moe.h"

namespace kvserve {

// elementwise.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin, int64_t num_rotated_heads, int64_t head_dim);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
// Each row's greedy token: the first index of its largest value, NaN counting as largest
// (torch.argmax's). logits: float32 [rows, vocab]; returns int64 [rows].
at::Tensor argmax_rows(const at::Tensor& logits);

// The attention ops' per-layer variants, all off by default: `window` > 0 limits a query at
// position q to keys (q - window, q] (blocks wholly before the window may be placeholders
// and are never read), `softcap` > 0 maps each scaled score s to softcap * tanh(s /
// softcap) before masking, and `sinks` ([num_heads] float32) adds exp(sink) of each query
// head to its softmax denominator.

// paged_attention.cpp
void write_kv(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& qkv,
              const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim);
void paged_decode_attention(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t num_heads,
                            int64_t num_kv_heads, double scale,
                            const std::optional<at::Tensor>& key_scale,
                            const std::optional<at::Tensor>& value_scale, int64_t window = 0,
                            double softcap = 0.0,
                            const std::optional<at::Tensor>& sinks = std::nullopt);

// prefill_attention.cpp
void paged_prefill_attention(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& num_computed,
                             int64_t num_heads, int64_t num_kv_heads, double scale,
                             const std::optional<at::Tensor>& key_scale,
                             const std::optional<at::Tensor>& value_scale, int64_t window = 0,
                             double softcap = 0.0,
                             const std::optional<at::Tensor>& sinks = std::nullopt);

// cpu_features.cpp: whether this CPU and kernel run AMX-BF16 tiles (and KVSERVE_CPU_ISA is
// unset); the prefill attention kernel then takes them for head_dim % 32 == 0, and
// bf16_linear_amx runs.
bool amx_available();

// bf16_linear_amx.cpp: out = x @ weight.T in bf16 on AMX tiles, any number of rows; needs
// amx_available() and in_features % 32 == 0, out_features % 16 == 0.
void bf16_linear_amx(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight);

// int8_linear.cpp
void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& scales);

// int8_linear_vnni.cpp (VNNI) and int8_linear_avx2.cpp (the same math on AVX2)
bool int8_vnni_supported();
bool int8_integer_supported();
bool int8_integer_avx2_supported();
void int8_linear_integer_avx2(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales);
void int8_linear_vnni(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& scales);

// bf16_linear.cpp
bool bf16_linear_supported();
void bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight);

// f32_linear.cpp: float32 rows (at most projection.h's kF32FewRows) on AVX2 + FMA
bool f32_linear_supported();
void f32_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight);

// int4_linear.cpp
void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& params);

// decode_layers.cpp
at::Tensor decode_layers(at::Tensor& residual, at::TensorList weights, at::IntArrayRef kinds,
                         at::TensorList qk_norms, const c10::intrusive_ptr<MoELayers>& moe,
                         at::Tensor& key_cache, at::Tensor& value_cache,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale,
                         double residual_multiplier);

// moe.cpp / moe.h: a mixture-of-experts feed-forward (moe_forward, MoEWeights).

// block_copy.cpp
void copy_blocks_serial_(at::Tensor& dst, const at::Tensor& src, at::IntArrayRef src_blocks,
                         at::IntArrayRef dst_blocks);

// token_mask.cpp
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows,
                          at::IntArrayRef mask_rows, int64_t vocab_size);

// lora.cpp: y[r] += (x[r] @ a[s].T) @ bt[s] for each row r of adapter slot s = row_slots[r]
// (-1: untouched); a [slots * parts * rank, in], bt [slots * parts * rank, out], one dtype
// throughout; spans [slots, parts, 2] int64: the columns [begin, end) outside which a part's
// block of bt is zero (begin == end: the slot has no such part).
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                const at::Tensor& row_slots, const at::Tensor& spans);

}  // namespace kvserve
