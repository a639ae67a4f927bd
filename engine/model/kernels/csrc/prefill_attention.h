// Shared by the three implementations of paged prefill attention: float32 tile products
// (prefill_attention.cpp, every CPU and dtype), bf16 tile products
// (prefill_attention_bf16.cpp, bf16 models on CPUs with AVX512_BF16) and AMX tiles
// (prefill_attention_amx.cpp, bf16 models on CPUs with AMX-BF16). All take the same
// work list: one task is one KV head of one request's span and a tile of its query rows.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace kvserve::prefill {

constexpr int64_t kQueryTile = 64;  // query rows per task (times the GQA group)
constexpr int64_t kKeyTile = 128;   // keys per softmax tile

// One unit of work: KV head `head` of span `span`, query rows [row_begin, row_end) of it.
// Its rows attend to keys [first_key, keys): every earlier key lies before the first row's
// sliding window (first_key is 0 without one), and its blocks are never read.
struct Task {
  int64_t span;
  int64_t head;
  int64_t row_begin;
  int64_t row_end;
  int64_t keys;  // keys up to the last row's position
  int64_t first_key;
};

// One call's operands as raw pointers (a bf16 model: qkv and out are bfloat16).
struct Bf16Problem {
  const at::BFloat16* qkv;
  int64_t width;  // qkv row length
  at::BFloat16* out;
  const void* key_cache;  // [kv_heads, blocks, block_size, head_dim] of cache_dtype
  const void* value_cache;
  at::ScalarType cache_dtype;
  const float* key_scales;  // [kv_heads, blocks * block_size] for an int8 cache, else null
  const float* value_scales;
  const int64_t* tables;  // [spans, max_blocks]
  int64_t max_blocks;
  const int64_t* starts;    // [spans + 1] first qkv row of each span
  const int64_t* computed;  // [spans] tokens cached before each span
  int64_t group;            // query heads per KV head
  int64_t num_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t head_stride;   // elements between two KV heads' slabs
  int64_t scale_stride;  // floats between two KV heads' scales
  float scale;
  int64_t window;      // sliding window in tokens, 0: none
  float softcap;       // logit soft cap, 0: none
  const float* sinks;  // [num_heads] sink logits, or null
};

// Whether run_bf16_tiles can serve this head size on this CPU (AVX512_BF16, even head_dim).
bool bf16_tiles_supported(int64_t head_dim);

// Runs every task with bf16 tile products (float32 accumulation and softmax).
void run_bf16_tiles(const std::vector<Task>& tasks, const Bf16Problem& problem);

// Whether run_amx_tiles can serve this head size here: AMX-BF16, the kernel's grant of
// tile state, KVSERVE_CPU_ISA unset, head_dim % 32 == 0 (prefill_attention_amx.cpp).
bool amx_tiles_supported(int64_t head_dim);

// The same tasks and numerics as run_bf16_tiles, the products on AMX tiles.
void run_amx_tiles(const std::vector<Task>& tasks, const Bf16Problem& problem);

}  // namespace kvserve::prefill
