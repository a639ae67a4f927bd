// What the two bf16 prefill kernels share (prefill_attention_bf16.cpp with vdpbf16ps,
// prefill_attention_amx.cpp with AMX tiles): finding a key tile's K and V rows through the
// block table (widened to bf16 when the cache is narrower), the value-pair layout both
// products read, and the exp both softmaxes use. Everything here is compiled for
// AVX512_BF16 through a target attribute and called only where the CPU has it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "prefill_attention.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVSERVE_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define KVSERVE_HAVE_BF16_PREFILL 1
#endif

namespace kvserve::prefill {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;  // e^x = 2^(x log2e)

// Storage on 64-byte cache lines for the tiles' buffers: a tile row or a 64-byte vector
// that straddles two lines costs two loads (and malloc's large blocks sit 16 bytes past a
// page). Elements are left uninitialised by resize(); assign() fills them.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialised: no zeroing of a fresh buffer
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};

template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// One key tile's K and V rows as bf16 pointers: into the cache itself when it holds bf16,
// else into `widened` (an int8 row times its token's scale). Rows past the tile's keys
// point at an all-zero row, so padded products add zeros, never garbage.
struct KeyValueRows {
  std::vector<const uint16_t*> keys, values;  // [padded keys]
  LineVector<uint16_t> widened;               // [2][padded keys][head_dim]
  LineVector<uint16_t> zero;                  // [head_dim]

  void reset(int64_t head_dim, int64_t padded_keys) {
    keys.resize(padded_keys);
    values.resize(padded_keys);
    widened.resize(2 * padded_keys * head_dim);
    zero.assign(head_dim, 0);
  }

  // Points the rows at keys [begin, begin + count) of the task's span.
  template <typename cache_t>
  void locate(const Bf16Problem& p, const Task& task, int64_t begin, int64_t count) {
    const int64_t* blocks = p.tables + task.span * p.max_blocks;
    const int64_t d = p.head_dim;
    const auto* key_cache = static_cast<const cache_t*>(p.key_cache) + task.head * p.head_stride;
    const auto* value_cache =
        static_cast<const cache_t*>(p.value_cache) + task.head * p.head_stride;
    const float* k_scales = p.key_scales ? p.key_scales + task.head * p.scale_stride : nullptr;
    const float* v_scales = p.value_scales ? p.value_scales + task.head * p.scale_stride : nullptr;
    for (int64_t n = 0; n < count; ++n) {
      const int64_t t = begin + n;
      const int64_t slot = blocks[t / p.block_size] * p.block_size + t % p.block_size;
      if constexpr (std::is_same_v<cache_t, at::BFloat16>) {
        keys[n] = reinterpret_cast<const uint16_t*>(key_cache + slot * d);
        values[n] = reinterpret_cast<const uint16_t*>(value_cache + slot * d);
      } else {
        auto* k_row = reinterpret_cast<at::BFloat16*>(widened.data() + n * d);
        auto* v_row = reinterpret_cast<at::BFloat16*>(widened.data() + (keys.size() + n) * d);
        const float k_factor = k_scales ? k_scales[slot] : 1.f;
        const float v_factor = v_scales ? v_scales[slot] : 1.f;
        for (int64_t i = 0; i < d; ++i) {
          k_row[i] = static_cast<float>(key_cache[slot * d + i]) * k_factor;
          v_row[i] = static_cast<float>(value_cache[slot * d + i]) * v_factor;
        }
        keys[n] = reinterpret_cast<const uint16_t*>(k_row);
        values[n] = reinterpret_cast<const uint16_t*>(v_row);
      }
    }
    for (int64_t n = count; n < static_cast<int64_t>(keys.size()); ++n) {
      keys[n] = values[n] = zero.data();
    }
  }
};

// A task's query rows as both bf16 kernels stack them, group-major: row r = g * tile + i is
// query i of the task's g-th query head (the heads sharing its KV head). Calls
// fn(r, query, out, position) with that row's query in qkv, its slot in out and its token
// position.
template <typename F>
void for_each_task_row(const Bf16Problem& p, const Task& task, F&& fn) {
  const int64_t tile = task.row_end - task.row_begin;
  const int64_t first_row = p.starts[task.span] + task.row_begin;
  const int64_t first_position = p.computed[task.span] + task.row_begin;
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t column = (task.head * p.group + g) * p.head_dim;
    for (int64_t i = 0; i < tile; ++i) {
      const int64_t row = first_row + i;
      fn(g * tile + i, p.qkv + row * p.width + column,
         p.out + row * p.num_heads * p.head_dim + column, first_position + i);
    }
  }
}

// Runs every task on the op's threads: each thread makes its own scratch (and whatever
// per-thread state make_scratch sets up) and takes the next task as it finishes one, so
// the costly tasks, which make_tasks puts first, spread over the threads.
// run(cache_t tag, task, scratch) does one task.
template <typename MakeScratch, typename Run>
void run_in_parallel(const std::vector<Task>& tasks, at::ScalarType cache_dtype,
                     MakeScratch&& make_scratch, Run&& run) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  with_cache_type(cache_dtype, [&](auto tag) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      auto scratch = make_scratch();
      for (int64_t worker = begin; worker < end; ++worker) {
        for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
          run(tag, tasks[i], scratch);
        }
      }
    });
  });
}

#ifdef KVSERVE_HAVE_BF16_PREFILL

// dst[j * dst_stride + d] = (v[2j][d], v[2j+1][d]) for j < pairs: the value layout both
// bf16 products multiply (keys in pairs down the rows, head dims along them).
KVSERVE_BF16_TARGET inline void interleave_value_pairs(const KeyValueRows& rows, int64_t pairs,
                                                       int64_t head_dim, uint32_t* dst,
                                                       int64_t dst_stride) {
  alignas(64) static constexpr uint16_t kLow[32] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {
      16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_load_si512(kHigh);
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* even = rows.values[2 * j];
    const uint16_t* odd = rows.values[2 * j + 1];  // the zero row past the last key
    uint32_t* out = dst + j * dst_stride;
    for (int64_t d = 0; d < head_dim; d += 32) {
      const int64_t left = std::min<int64_t>(32, head_dim - d);
      const __mmask32 keep = left == 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(keep, even + d);
      const __m512i b = _mm512_maskz_loadu_epi16(keep, odd + d);
      const __mmask16 keep_low = static_cast<__mmask16>(left >= 16 ? 0xffff : (1u << left) - 1);
      _mm512_mask_storeu_epi32(out + d, keep_low, _mm512_permutex2var_epi16(a, low, b));
      if (left > 16) {
        const __mmask16 keep_high =
            static_cast<__mmask16>(left == 32 ? 0xffff : (1u << (left - 16)) - 1);
        _mm512_mask_storeu_epi32(out + d + 16, keep_high, _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }
}

// 2^t for t <= 0: t = n + f with |f| <= 1/2, 2^f by its Taylor polynomial to degree 4
// (relative error < 5e-5, a tenth of a bf16 probability's rounding), scaled by 2^n with
// vscalefps.
KVSERVE_BF16_TARGET inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(9.6181291076284772e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

#endif  // KVSERVE_HAVE_BF16_PREFILL

}  // namespace kvserve::prefill
