// How the sm80 flash forward lays out a problem that it runs: whether it packs the query heads of
// each key/value head into its tiles (dispatch_policy.h pack_gqa) and into how many key chunks
// it splits (split_kv.h split_count), with the workspace that the split needs. attention_cuda.cu
// decides the sm80 launch, the forward's workspace size and whether the Hopper forward runs from
// this one plan, so the three never disagree.
//
// Pure host code over AttentionParams, so a test compiles it alone (tests/ops/cuda/test_dispatch_policy.py,
// tests/ops/cuda/test_cuda_sm90_build.py).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch_policy.h"
#include "kernel_traits.h"
#include "split_kv.h"

namespace attn_export::cuda {

// The compiled flash head dim a problem runs on (its columns past head_dim and head_dim_v
// masked); 0 when none fits. Both dims must be multiples of 8 elements (16 bytes): the padded
// loads and stores work in 16-byte chunks and element pairs. Without the preview switch only the
// verified head dims run on the flash kernels (the others on the generic kernels).
inline int flash_tile_dim(const AttentionParams& p, bool preview) {
  const bool chunked = p.head_dim > 0 && p.head_dim_v > 0 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0;
  if (!preview && !policy::verified_flash_head_dims(p.head_dim, p.head_dim_v)) {
    return 0;
  }
  return chunked ? flash_tile_head_dim(p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v) : 0;
}

// The flash forward's tile rows and keys (FlashFwdTraits) at a compiled head dim and row tiles a
// warp; {0, 0, 1} for none.
struct FlashFwdBlocks {
  int block_m = 0, block_n = 0, row_tiles = 1;
};

template <int kRowTiles = 1, int kIndex = 0>
constexpr FlashFwdBlocks flash_fwd_blocks(int tile_dim) {
  if constexpr (kIndex == kNumFlashHeadDims) {
    return {};
  } else {
    using Traits = FlashFwdTraits<kFlashHeadDims[kIndex], kRowTiles>;
    return tile_dim == kFlashHeadDims[kIndex] ? FlashFwdBlocks{Traits::kBlockM, Traits::kBlockN, kRowTiles}
                                              : flash_fwd_blocks<kRowTiles, kIndex + 1>(tile_dim);
  }
}

inline size_t round_up_256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// The plan: packed or not, the split (num_splits 1: none) and its workspace,
// [out_accum: chunks * rows * head_dim_v floats][lse_accum: chunks * rows floats], 256-byte parts.
struct FlashFwdPlan {
  FlashFwdBlocks blocks;
  bool pack_gqa = false;
  SplitCount split;
  size_t out_bytes = 0, lse_bytes = 0;

  size_t workspace_bytes() const { return out_bytes + lse_bytes; }
  // Whether the forward splits the keys given `available` bytes of workspace: without enough, it
  // runs unsplit.
  bool splits(size_t available) const { return split.num_splits > 1 && available >= workspace_bytes(); }
};

// Splits the plan's keys (split-KV, preview) when its programs cannot fill `sm_count` SMs.
inline void plan_split_kv(FlashFwdPlan& plan, const AttentionParams& p, int sm_count) {
  const int block_m = plan.blocks.block_m, block_n = plan.blocks.block_n;
  // The programs before any split: query tiles x heads x batch, or packed, tiles of a group's rows
  // x key/value heads x batch. The keys any row sees: under causality, none past the last row's diagonal.
  const int64_t programs = plan.pack_gqa
      ? p.batch * p.num_heads_k * ((p.num_heads / p.num_heads_k * p.seqlen_q + block_m - 1) / block_m)
      : p.batch * p.num_heads * ((p.seqlen_q + block_m - 1) / block_m);
  int64_t key_end = p.seqlen_k;
  if (p.is_causal) {
    const int64_t last = p.seqlen_q + p.causal_shift();
    key_end = last < 0 ? 0 : (last < p.seqlen_k ? last : p.seqlen_k);
  }
  const SplitCount count = split_count(programs, (key_end + block_n - 1) / block_n, sm_count);
  if (count.num_splits < 2 || p.batch * count.num_splits > 65535) {  // grid z holds batch * chunks
    return;
  }
  plan.split = count;
  const size_t rows = static_cast<size_t>(count.num_splits * p.batch * p.num_heads * p.seqlen_q);
  plan.out_bytes = round_up_256(rows * static_cast<size_t>(p.head_dim_v) * sizeof(float));
  plan.lse_bytes = round_up_256(rows * sizeof(float));
}

// The plan of a valid problem (attention_params_error: none) that the flash forward runs, at
// compiled head dim `tile_dim`, on `sm_count` SMs. Split-KV, packing and the 128-row blocks are
// preview features. Packing and the split are decided on the 64-row tiles (decode-shaped work);
// the 128-row blocks (policy::wide_forward_tiles) only where neither was chosen, so a plan that
// splits or packs is the same with or without them, and `blocks` is what the forward launches.
inline FlashFwdPlan flash_fwd_plan(const AttentionParams& p, int tile_dim, int sm_count, bool preview) {
  FlashFwdPlan plan;
  plan.blocks = flash_fwd_blocks(tile_dim);
  if (plan.blocks.block_m == 0 || p.batch <= 0 || p.num_heads <= 0 || p.seqlen_q <= 0) {
    return plan;
  }
  plan.pack_gqa = policy::pack_gqa(p, plan.blocks.block_m, preview);
  if (policy::allowed(policy::kSplitKv, preview)) {
    plan_split_kv(plan, p, sm_count);
  }
  const FlashFwdBlocks wide = flash_fwd_blocks<kWideFwdRowTiles>(tile_dim);
  const bool compiled = wide_fwd_head_dim(tile_dim) && !plan.pack_gqa && plan.split.num_splits <= 1;
  const int64_t programs = p.batch * p.num_heads * ((p.seqlen_q + plan.blocks.block_m - 1) / plan.blocks.block_m);
  const int64_t wide_programs = p.batch * p.num_heads * ((p.seqlen_q + wide.block_m - 1) / wide.block_m);
  if (policy::wide_forward_tiles(compiled, programs, wide_programs, sm_count, preview)) {
    plan.blocks = wide;
  }
  return plan;
}

// ---- The Hopper forward's share (dispatch_policy.h kHopperForward).
//
// The Hopper forward has neither split-KV nor packed query heads: one block per (128 query rows,
// head, batch). Decode-shaped work is where the sm80 forward's plan has them, and there the
// Hopper forward declines and the sm80 forward runs:
//   - the sm80 forward would split the keys (its query tiles cannot fill the SMs, and the caller
//     passed the workspace the split needs: `workspace_bytes`; the PyTorch binding and the
//     TensorRT plugin do);
//   - it would pack grouped query heads whose rows, per head, fill less than one of its query tiles
//     (seqlen_q < its block_m: decode, a few speculative tokens), where the Hopper forward's
//     128-row tiles would be nearly empty and stream each key/value tile once per query head.
// pack_gqa also packs longer queries whose last tile it fills better (97 rows: 13 tiles of 8
// heads instead of 16); those are prefill, and stay on the Hopper forward.
// The plan's 128-row blocks (policy::wide_forward_tiles) change nothing here: they are chosen only
// where the plan neither splits nor packs, so the decision is the one the 64-row plan gives
// (decode shape or not), whatever block_m the sm80 forward would launch.
// `p`: params the Hopper forward supports (sm90::supports), so the flash forward would run them.
inline bool hopper_forward_declines(const FlashFwdPlan& plan, const AttentionParams& p, size_t workspace_bytes) {
  return plan.splits(workspace_bytes) || (plan.pack_gqa && p.seqlen_q < plan.blocks.block_m);
}

inline bool hopper_forward_declines(const AttentionParams& p, int sm_count, size_t workspace_bytes, bool preview) {
  return hopper_forward_declines(flash_fwd_plan(p, flash_tile_dim(p, preview), sm_count, preview), p, workspace_bytes);
}

}  // namespace attn_export::cuda
