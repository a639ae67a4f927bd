// The cache lines of a decode-attention task still to come, asked for into L2 a few at a
// time from inside the current task's product loops (paged_attention.cpp).
//
// A task's rows (128 tokens of one KV head, 32 KiB for a bf16 cache at head_dim 64) are
// scattered over blocks of the pool, where the hardware prefetcher sees no stream, so they
// are asked for in software. Asked for in one burst, 512 prefetches filled the core's miss
// queue and stalled its thread for as long as the lines took to arrive: the products and
// the memory took turns, and a 32-sequence step's attention ran at the sum of its compute
// and its transfer. Fed a few lines per loop step, the next task's lines arrive while the
// current task computes.
#pragma once

#include <cstdint>

namespace kvserve {

class LineFeed {
 public:
  // Runs of at most this many: a key and a value run per block a task touches.
  static constexpr int kMaxRuns = 2 * 130;

  // Lines [start, start + bytes) join the feed (in order, after those already in it);
  // false (nothing added) once kMaxRuns runs are held.
  bool add(const void* start, int64_t bytes) {
    if (count_ == kMaxRuns || bytes <= 0) return count_ < kMaxRuns;
    starts_[count_] = static_cast<const char*>(start);
    lines_[count_] = static_cast<int32_t>((bytes + 63) / 64);
    total_ += lines_[count_];
    ++count_;
    return true;
  }

  int64_t total_lines() const { return total_; }

  // How many lines each of `steps` loop steps should ask for to finish the feed.
  void spread_over(int64_t steps) {
    per_step_ = steps > 0 ? static_cast<int32_t>((total_ + steps - 1) / steps) : total_;
  }

  // One loop step's share of the lines.
  inline void step() { ask(per_step_); }

  // Every line not yet asked for.
  void drain() { ask(INT32_MAX); }

 private:
  inline void ask(int32_t n) {
    while (n-- > 0 && run_ < count_) {
      const char* line = starts_[run_] + 64 * static_cast<int64_t>(line_);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
      asm volatile("prefetcht1 %0" : : "m"(*line));
#else
      __builtin_prefetch(line, 0, 2);
#endif
      if (++line_ == lines_[run_]) {
        ++run_;
        line_ = 0;
      }
    }
  }

  const char* starts_[kMaxRuns];
  int32_t lines_[kMaxRuns];
  int32_t count_ = 0;
  int32_t run_ = 0;
  int32_t line_ = 0;
  int32_t per_step_ = 0;
  int64_t total_ = 0;
};

}  // namespace kvserve
