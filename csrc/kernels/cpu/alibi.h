// ALiBi's bias on a row of scores (attention_params.h): -slope * |i + seqlen_k - seqlen_q - j|, added
// where the masks are. Shared by the row kernels (attention_cpu.cpp) and the flash kernels
// (flash_cpu.cpp), forward and backward, so that the backward recomputes exactly the forward's scores.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "../../attention_params.h"

namespace attn_export::cpu {

// row[j] -= slope * |distance0 - j| for j < cols: the scores of query i against keys j0 + j, with
// distance0 = p.alibi_diagonal(i) - j0 and slope = p.alibi_slopes[h]. The slope is float32 (the
// params' type) and the product is rounded in T, as every kernel computes it.
template <typename T>
inline void add_alibi_row(T* row, int64_t cols, T slope, int64_t distance0) {
  for (int64_t j = 0; j < cols; ++j) {
    row[j] -= slope * static_cast<T>(std::llabs(distance0 - j));
  }
}

// The bias of query row i (head h) over keys [j0, j0 + cols), when the params have slopes.
template <typename T>
inline void add_alibi(const AttentionParams& p, int64_t h, int64_t i, int64_t j0, int64_t cols, T* row) {
  if (p.alibi_slopes != nullptr) {
    add_alibi_row(row, cols, static_cast<T>(p.alibi_slopes[h]), p.alibi_diagonal(i) - j0);
  }
}

}  // namespace attn_export::cpu
