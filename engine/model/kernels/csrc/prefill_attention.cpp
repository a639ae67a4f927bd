// Prefill (and chunked-prefill) attention straight from the paged KV cache, flash style:
// each task takes one KV head and a tile of one request's query rows (all the query heads
// that share the KV head, stacked), walks the request's cached keys in tiles read through
// its block table, and keeps an online softmax (running max, running sum, rescaled output),
// so nothing the size of [queries, context] is ever materialised: no gathered copy of the
// context, no mask tensor. Causality is applied per row inside the tiles that need it, and
// so is a sliding window: a task starts at its first row's window (tiles wholly before it,
// and their blocks, are never touched) and masks the tiles that cross a row's window start.
// A soft cap maps each tile's scores before the masks; sinks start each row's running max
// at the sink's logit and its running sum at 1, so they join the denominator only.
//
// The two products per tile (scores = Q K^T, out += P V) run as float32 GEMMs through the
// BLAS that torch links (MKL's sgemm_), with a portable loop where that symbol is absent.
// K/V tiles are widened to float32 (int8 rows times their per-token scales) as they are
// gathered, so every cache dtype shares one code path. A bf16 model on a CPU with
// AVX512_BF16 takes prefill_attention_bf16.cpp instead: the same tasks with bf16 products
// (on AMX tiles, prefill_attention_amx.cpp, where the CPU has AMX-BF16).

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "common.h"
#include "ops.h"
#include "prefill_attention.h"

// Fortran BLAS as exported by torch's MKL; weak, so a torch without it still loads us.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace kvserve {
namespace {

using prefill::kKeyTile;
using prefill::kQueryTile;
using prefill::Task;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Column-major C[m x n] = alpha * op(A) op(B) + beta * C, as BLAS defines it.
void gemm(bool trans_a, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (sgemm_ != nullptr) {
    const char ta = trans_a ? 'T' : 'N';
    const char tb = 'N';
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
    const float one = 1.f;
    sgemm_(&ta, &tb, &mi, &ni, &ki, &one, a, &la, b, &lb, &beta, c, &lc);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.f;
      for (int64_t p = 0; p < k; ++p) {
        const float av = trans_a ? a[i * lda + p] : a[p * lda + i];
        acc += av * b[j * ldb + p];
      }
      c[j * ldc + i] = acc + (beta == 0.f ? 0.f : beta * c[j * ldc + i]);
    }
  }
}

struct Scratch {
  std::vector<float> query;   // [group * tile, head_dim], pre-scaled
  std::vector<float> keys;    // [kKeyTile, head_dim]
  std::vector<float> values;  // [kKeyTile, head_dim]
  std::vector<float> scores;  // [group * tile, kKeyTile]
  std::vector<float> out;     // [group * tile, head_dim]
  std::vector<float> row_max, row_sum;
};

// Widens tokens [begin, end) of one KV head's slab into rows of `dst` (float32), reading
// the blocks the table names; an int8 cache's rows are multiplied by their token scale.
template <typename cache_t>
void gather_rows(const cache_t* head, const float* scales, const int64_t* blocks,
                 int64_t block_size, int64_t head_dim, int64_t begin, int64_t end, float* dst) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
    const cache_t* src = head + slot * head_dim;
    float* row = dst + (t - begin) * head_dim;
    const float factor = scales != nullptr ? scales[slot] : 1.f;
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(src[d]) * factor;
  }
}

// Hides the keys each query row may not see: those after its own position and, with a
// sliding window, those before its window (rows stacked group-major: row g * tile + i is
// query i of head g, at position first_position + i).
void mask_invisible(float* scores, int64_t group, int64_t tile, int64_t first_position,
                    int64_t key_begin, int64_t num_keys, int64_t window) {
  for (int64_t i = 0; i < tile; ++i) {
    const int64_t position = first_position + i;
    const int64_t visible_end = std::clamp<int64_t>(position + 1 - key_begin, 0, num_keys);
    const int64_t visible_begin =
        std::clamp<int64_t>(window_start(position, window) - key_begin, 0, visible_end);
    if (visible_begin == 0 && visible_end == num_keys) continue;
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores + (g * tile + i) * kKeyTile;
      std::fill(row, row + visible_begin, kNegInf);
      std::fill(row + visible_end, row + num_keys, kNegInf);
    }
  }
}

// Folds one tile of scores into the running softmax: scores become unnormalised
// probabilities against the new running max, and out rows are rescaled to it.
void online_softmax(Scratch& s, int64_t rows, int64_t num_keys, int64_t head_dim) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s.scores.data() + r * kKeyTile;
    const float tile_max = *std::max_element(row, row + num_keys);
    if (tile_max == kNegInf) {  // every key of this tile is in the row's future
      std::fill(row, row + num_keys, 0.f);
      continue;
    }
    const float new_max = std::max(s.row_max[r], tile_max);
    const float correction = std::exp(s.row_max[r] - new_max);  // 0 for the first tile
    const float tile_sum = exp_shifted_sum(row, num_keys, new_max);
    s.row_sum[r] = s.row_sum[r] * correction + tile_sum;
    s.row_max[r] = new_max;
    if (correction != 1.f) {
      float* o = s.out.data() + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= correction;
    }
  }
}

// The attention variants as one task sees them: the window, the soft cap, and the sink
// logits of the task's query heads (null without sinks).
struct Variants {
  int64_t window;
  float softcap;
  const float* sinks;
};

template <typename scalar_t, typename cache_t>
void run_task(const Task& task, const scalar_t* qkv, int64_t width, scalar_t* out,
              const cache_t* k_head, const cache_t* v_head, const float* k_scales,
              const float* v_scales, const int64_t* blocks, int64_t first_row,
              int64_t num_computed, int64_t group, int64_t num_heads, int64_t head_dim,
              int64_t block_size, float scale, const Variants& variants, Scratch& s) {
  const int64_t tile = task.row_end - task.row_begin;
  const int64_t rows = group * tile;
  s.query.resize(rows * head_dim);
  s.keys.resize(kKeyTile * head_dim);
  s.values.resize(kKeyTile * head_dim);
  s.scores.resize(rows * kKeyTile);
  s.out.assign(rows * head_dim, 0.f);
  s.row_max.assign(rows, kNegInf);
  s.row_sum.assign(rows, 0.f);
  for (int64_t r = 0; variants.sinks != nullptr && r < rows; ++r) {
    s.row_max[r] = variants.sinks[r / tile];  // exp(sink - max) = 1 against its own max
    s.row_sum[r] = 1.f;
  }
  for (int64_t i = 0; i < tile; ++i) {
    const scalar_t* q = qkv + (first_row + task.row_begin + i) * width;
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + (task.head * group + g) * head_dim;
      float* dst = s.query.data() + (g * tile + i) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
  const int64_t first_position = num_computed + task.row_begin;
  // Tiles starting before the last row's window start cross some row's window start.
  const int64_t last_window_start = window_start(first_position + tile - 1, variants.window);
  for (int64_t key_begin = task.first_key; key_begin < task.keys; key_begin += kKeyTile) {
    const int64_t num_keys = std::min(kKeyTile, task.keys - key_begin);
    gather_rows(k_head, k_scales, blocks, block_size, head_dim, key_begin,
                key_begin + num_keys, s.keys.data());
    // scores^T [keys x rows] = K [keys x d] . Q^T: column-major view of row-major scores.
    gemm(true, num_keys, rows, head_dim, s.keys.data(), head_dim, s.query.data(), head_dim,
         0.f, s.scores.data(), kKeyTile);
    for (int64_t r = 0; variants.softcap > 0.f && r < rows; ++r) {
      soft_cap(s.scores.data() + r * kKeyTile, num_keys, variants.softcap);
    }
    if (key_begin + num_keys > first_position + 1 || key_begin < last_window_start) {
      mask_invisible(s.scores.data(), group, tile, first_position, key_begin, num_keys,
                     variants.window);
    }
    online_softmax(s, rows, num_keys, head_dim);
    gather_rows(v_head, v_scales, blocks, block_size, head_dim, key_begin,
                key_begin + num_keys, s.values.data());
    // out^T [d x rows] += V^T [d x keys] . P^T [keys x rows]
    gemm(false, head_dim, rows, num_keys, s.values.data(), head_dim, s.scores.data(), kKeyTile,
         1.f, s.out.data(), head_dim);
  }
  for (int64_t i = 0; i < tile; ++i) {
    scalar_t* o = out + (first_row + task.row_begin + i) * num_heads * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = g * tile + i;
      const float inv_sum = 1.f / s.row_sum[r];
      const float* src = s.out.data() + r * head_dim;
      scalar_t* dst = o + (task.head * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv_sum);
    }
  }
}

// Every (span, KV head, query tile), most expensive first so that the dynamic hand-out
// below ends with the cheap ones (causal tiles late in a prompt cost far more, unless a
// window bounds them).
std::vector<Task> make_tasks(const int64_t* starts, const int64_t* computed, int64_t spans,
                             int64_t num_kv_heads, int64_t window) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < spans; ++s) {
    const int64_t rows = starts[s + 1] - starts[s];
    for (int64_t begin = 0; begin < rows; begin += kQueryTile) {
      const int64_t end = std::min(rows, begin + kQueryTile);
      const int64_t first_key = window_start(computed[s] + begin, window);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        tasks.push_back(Task{s, h, begin, end, computed[s] + end, first_key});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return a.keys - a.first_key > b.keys - b.first_key;
  });
  return tasks;
}

}  // namespace

void paged_prefill_attention(
    at::Tensor& out, const at::Tensor& qkv, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& query_starts, const at::Tensor& num_computed, int64_t num_heads,
    int64_t num_kv_heads, double scale, const std::optional<at::Tensor>& key_scale,
    const std::optional<at::Tensor>& value_scale, int64_t window, double softcap,
    const std::optional<at::Tensor>& sinks) {
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(qkv, "qkv");
  check_cpu_contiguous(key_cache, "key_cache");
  check_cpu_contiguous(value_cache, "value_cache");
  check_cpu_contiguous(block_tables, "block_tables");
  check_cpu_contiguous(query_starts, "query_starts");
  check_cpu_contiguous(num_computed, "num_computed");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_starts.scalar_type() == at::kLong &&
                  num_computed.scalar_type() == at::kLong,
              "block_tables, query_starts and num_computed must be int64");
  const int64_t spans = block_tables.size(0);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(query_starts.numel() == spans + 1 && num_computed.numel() == spans,
              "query_starts must hold spans + 1 offsets and num_computed one per span");
  const int64_t num_blocks = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t head_dim = key_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t width = qkv.size(1);
  TORCH_CHECK(out.size(0) == qkv.size(0) && out.size(1) == num_heads * head_dim,
              "out must be [rows, heads * head_dim]");
  const int64_t head_stride = num_blocks * block_size * head_dim;
  const int64_t scale_stride = num_blocks * block_size;
  const bool quantized = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == (key_scale.has_value() && value_scale.has_value()),
              "an int8 KV cache needs key_scale and value_scale, other caches none");
  const float* k_scales = quantized ? key_scale->data_ptr<float>() : nullptr;
  const float* v_scales = quantized ? value_scale->data_ptr<float>() : nullptr;
  const float* sink_logits = check_attention_variants(window, softcap, sinks, num_heads);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* computed = num_computed.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[spans] == qkv.size(0), "query_starts must cover qkv");
  for (int64_t s = 0; s < spans; ++s) {
    TORCH_CHECK(starts[s + 1] > starts[s] && computed[s] >= 0, "empty span or bad offset");
    const int64_t context = computed[s] + starts[s + 1] - starts[s];
    TORCH_CHECK(context <= max_blocks * block_size, "context longer than the block table");
    // Blocks before the span's first row's window may be placeholders: not checked.
    const int64_t first_block = window_start(computed[s], window) / block_size;
    for (int64_t i = first_block; i < (context + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[s * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  const std::vector<Task> tasks = make_tasks(starts, computed, spans, num_kv_heads, window);
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  const bool amx = bf16 && prefill::amx_tiles_supported(head_dim);
  if (amx || (bf16 && prefill::bf16_tiles_supported(head_dim))) {
    const prefill::Bf16Problem problem{
        qkv.data_ptr<at::BFloat16>(), width, out.data_ptr<at::BFloat16>(),
        key_cache.data_ptr(), value_cache.data_ptr(), key_cache.scalar_type(),
        k_scales, v_scales, tables, max_blocks, starts, computed, group, num_heads, head_dim,
        block_size, head_stride, scale_stride, static_cast<float>(scale), window,
        static_cast<float>(softcap), sink_logits};
    if (amx) {
      prefill::run_amx_tiles(tasks, problem);
    } else {
      prefill::run_bf16_tiles(tasks, problem);
    }
    return;
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "paged_prefill", [&] {
    with_cache_type(key_cache.scalar_type(), [&](auto tag) {
      using cache_t = decltype(tag);
      const scalar_t* q = qkv.data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      const cache_t* kc = key_cache.data_ptr<cache_t>();
      const cache_t* vc = value_cache.data_ptr<cache_t>();
      std::atomic<int64_t> next{0};
      at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        Scratch scratch;
        for (int64_t worker = begin; worker < end; ++worker) {
          for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
            const Task& t = tasks[i];
            const Variants variants{window, static_cast<float>(softcap),
                                    sink_logits != nullptr ? sink_logits + t.head * group : nullptr};
            run_task(t, q, width, o, kc + t.head * head_stride, vc + t.head * head_stride,
                     quantized ? k_scales + t.head * scale_stride : nullptr,
                     quantized ? v_scales + t.head * scale_stride : nullptr,
                     tables + t.span * max_blocks, starts[t.span], computed[t.span], group,
                     num_heads, head_dim, block_size, static_cast<float>(scale), variants,
                     scratch);
          }
        }
      });
    });
  });
}

}  // namespace kvserve
