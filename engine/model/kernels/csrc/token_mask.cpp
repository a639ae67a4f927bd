// Structured outputs' token mask: logits the grammar disallows become -inf, for every
// constrained row of the batch in one call.
//
// The bitmask is xgrammar's layout: int32 words, bit b of word w allows token 32 * w + b.
// xgrammar's own CPU kernel branches per token, which costs ~5 ms a step at 32 rows of a
// 49k vocabulary on the irregular masks of JSON strings; here each word is one vector
// blend, and all-allowed words (most of a string's mask) are skipped.

#include <ATen/Parallel.h>

#include <limits>

#include "common.h"
#include "ops.h"

namespace kvserve {

namespace {

void mask_row(float* logits, const int32_t* words, int64_t vocab) {
  constexpr float kBlocked = -std::numeric_limits<float>::infinity();
  const int64_t full_words = vocab / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;
    float* p = logits + 32 * w;
    // Written branch-free so the compiler turns it into masked blends.
#pragma omp simd
    for (int b = 0; b < 32; ++b) {
      p[b] = ((bits >> b) & 1u) ? p[b] : kBlocked;
    }
  }
  const uint32_t tail = static_cast<uint32_t>(vocab > 32 * full_words ? words[full_words] : -1);
  for (int64_t t = 32 * full_words; t < vocab; ++t) {
    if (!((tail >> (t - 32 * full_words)) & 1u)) logits[t] = kBlocked;
  }
}

}  // namespace

// logits[rows[i], t] = -inf wherever bitmask[mask_rows[i]] does not allow t (t < vocab_size):
// the masks stay in the rows they were filled in (one per sequence), no gather first.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows,
                          at::IntArrayRef mask_rows, int64_t vocab_size) {
  check_cpu_contiguous(logits, "logits");
  check_cpu_contiguous(bitmask, "bitmask");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logits must be a 2-D float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt,
              "bitmask must be a 2-D int32 tensor");
  const int64_t vocab = std::min(vocab_size, logits.size(1));
  TORCH_CHECK(bitmask.size(1) * 32 >= vocab, "bitmask is narrower than the vocabulary");
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(mask_rows.size()) == n, "one mask row per logits row");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < logits.size(0), "logits row index out of range");
    TORCH_CHECK(mask_rows[i] >= 0 && mask_rows[i] < bitmask.size(0),
                "mask row index out of range");
  }
  float* lp = logits.data_ptr<float>();
  const int32_t* bp = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask_row(lp + rows[i] * logits.size(1), bp + mask_rows[i] * bitmask.size(1), vocab);
    }
  });
}

}  // namespace kvserve
