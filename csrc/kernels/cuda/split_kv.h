// Split-KV (flash-decoding): when the query tiles alone cannot fill the GPU (a decode step has
// one query row per head), the keys are cut into num_splits chunks of blocks_per_split key tiles
// and every (query tile, head, batch, chunk) is its own program. Each writes the chunk's partial
// output, normalized over the chunk, and the chunk's log-sum-exp into an fp32 workspace; a
// combine kernel then merges the chunks of each row by their log-sum-exp weights:
//
//     lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) * out_s
//
// A chunk that sees no key of a row has lse_s = -inf and weight 0; a row that sees no key in any
// chunk gets a zero output and lse = -inf, as everywhere (never NaN).
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn_export::cuda {

// The split of one forward; num_splits == 1 means none (the other fields are then unused).
struct SplitKv {
  int num_splits = 1;
  int blocks_per_split = 0;    // key tiles (the kernel's kBlockN keys each) per chunk
  float* out_accum = nullptr;  // [num_splits, batch, num_heads, seqlen_q, head_dim_v]
  float* lse_accum = nullptr;  // [num_splits, batch, num_heads, seqlen_q]
};

// The most chunks one forward uses, and the fewest key tiles a chunk gets: a chunk must stream
// enough keys to amortize writing its partial output row.
inline constexpr int kMaxSplits = 128;
inline constexpr int kMinBlocksPerSplit = 2;

// How many chunks for `programs` programs without a split (batch * heads * query tiles) over
// `key_blocks` key tiles on `sm_count` SMs: 1 when the programs fill the SMs; otherwise enough
// to give about two programs per SM, each chunk at least kMinBlocksPerSplit tiles, and no
// chunk empty (the count is recomputed from the tiles per chunk). Pure host arithmetic.
struct SplitCount {
  int num_splits = 1;
  int blocks_per_split = 0;
};
inline SplitCount split_count(int64_t programs, int64_t key_blocks, int sm_count) {
  SplitCount c;
  if (programs <= 0 || key_blocks <= 0 || sm_count <= 0 || programs >= sm_count) {
    return c;
  }
  int64_t splits = (2 * static_cast<int64_t>(sm_count) + programs - 1) / programs;
  const int64_t by_length = key_blocks / kMinBlocksPerSplit;
  splits = splits < by_length ? splits : by_length;
  splits = splits < kMaxSplits ? splits : kMaxSplits;
  if (splits < 2) {
    return c;
  }
  const int64_t per_split = (key_blocks + splits - 1) / splits;
  c.num_splits = static_cast<int>((key_blocks + per_split - 1) / per_split);
  c.blocks_per_split = static_cast<int>(per_split);
  if (c.num_splits < 2) {
    c = SplitCount{};
  }
  return c;
}

}  // namespace attn_export::cuda
