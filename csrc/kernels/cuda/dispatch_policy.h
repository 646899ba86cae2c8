// What the CUDA dispatch may run by default: only the paths measured on a GPU.
//
// The project's rule: GPU work that was not run on a GPU stays built and tested (the SIMT
// emulator, tests/ops/cuda/cuda_emulator/) but undispatched, until a GPU session verifies it. The
// verified set is what ran on an NVIDIA H200 at commit f427ebe (docs/cuda.md "Verification"):
// the flash kernels at head_dim == head_dim_v in {32, 64, 128} (the backward at 128 with 4 warps,
// no column split), every key/value head its own query head's, causality top-left only, one
// program per query tile. Everything else the kernels can do (further head dims and padded ones,
// grouped-query heads, the bottom-right causal alignment, the sliding window, split-KV decoding,
// the column-split head-dim-128 backward, skipping fully padded key tiles, grouped query heads
// packed into one forward tile, the forward's 128-row blocks, ALiBi slopes added in the kernels)
// runs only with the preview switch on:
//
//     ATTN_EXPORT_CUDA_PREVIEW=1      read once per process, on the host
//
// Without it, the PyTorch binding reaches the same results through verified code (key/value
// expanded to every query head, the bottom-right diagonal, the window and the ALiBi bias passed as a
// mask: csrc/ops/verified_inputs.h), and the kernels' own entry points refuse the features they
// cannot route around without memory (attention_params_error).
//
// Pure host code over AttentionParams, so a test compiles it alone (tests/ops/cuda/test_dispatch_policy.py).
#pragma once

#include <cstdint>

#include "../../attention_params.h"
#include "kernel_traits.h"

namespace attn_export::cuda::policy {

inline constexpr const char kPreviewEnvVar[] = "ATTN_EXPORT_CUDA_PREVIEW";

// The flash head dims verified on a GPU (each with head_dim_v equal to it).
inline constexpr int kVerifiedFlashHeadDims[] = {32, 64, 128};

// The paths that wait for a GPU, one bit each.
enum PreviewFeature : unsigned {
  kFlashHeadDim = 1u << 0,  // the flash kernels at any head dim pair but the verified ones
  kGroupedQuery = 1u << 1,  // num_heads_k < num_heads read in place by the kernels
  kBottomRight = 1u << 2,   // a nonzero causal shift in the kernels (bottom-right, seqlen_q != seqlen_k)
  kSplitKv = 1u << 3,       // split-KV decoding: partial results per key chunk, then a combine kernel
  kBwdColumnSplit = 1u << 4,  // the head-dim-128 backward's tiles with dK/dV columns split over 2 warps
  kKeyTileSkip = 1u << 5,     // the flash kernels skip the key tiles a key-padding mask pads entirely
  kWindow = 1u << 6,          // the sliding window (window > 0) masked in the kernels
  kHopperForward = 1u << 7,   // the sm_90a forward (kernels/cuda/hopper/): also needs kSm90EnvVar
  kPackGqa = 1u << 8,         // a group's query heads packed into one forward tile (decode with grouped heads)
  kHopperBackward = 1u << 9,  // the sm_90a backward (kernels/cuda/hopper/flash_bwd_sm90*): also needs kSm90EnvVar
  kWideForwardTiles = 1u << 10,  // the sm80 forward's 128-row blocks (two 16-row MMA tiles a warp) for prefill
  kAlibi = 1u << 11,             // ALiBi slopes (alibi_slopes) added per score by the kernels
};


inline bool verified_flash_head_dims(int64_t head_dim, int64_t head_dim_v) {
  return equal_head_dims_in(kVerifiedFlashHeadDims, head_dim, head_dim_v);
}

inline bool grouped_query(const AttentionParams& p) {
  return p.num_heads_k > 0 && p.num_heads_k != p.num_heads;
}

inline bool shifted_causal(const AttentionParams& p) {
  return p.is_causal && p.causal_shift() != 0;
}

inline bool windowed(const AttentionParams& p) {
  return p.is_causal && p.window > 0;
}

inline bool alibi(const AttentionParams& p) { return p.alibi_slopes != nullptr; }

// The features of the kernels these params need whatever path runs them (the flash head dims
// and split-KV are choices of the dispatch, not needs of the problem).
inline unsigned needed_features(const AttentionParams& p) {
  return (grouped_query(p) ? kGroupedQuery : 0u) | (shifted_causal(p) ? kBottomRight : 0u) |
      (windowed(p) ? kWindow : 0u) | (alibi(p) ? kAlibi : 0u);
}

// May the dispatch use `features`? Everything with the preview on; only what was verified without it.
inline bool allowed(unsigned features, bool preview) {
  return preview || features == 0;
}

// The column split of the flash backward at head dim 128 (kernel_traits.h): the tiles' choice
// (2, no spills) with the preview; the tiles verified at f427ebe (1) without it.
inline int flash_bwd_col_split_128(bool preview) {
  return allowed(kBwdColumnSplit, preview) ? 2 : 1;
}

// Whether the flash kernels skip the key tiles a key-padding mask pads entirely (key_tile_range.cuh):
// with the preview; without it they compute and mask those tiles, as verified at f427ebe.
inline bool skip_padded_key_tiles(const AttentionParams& p, bool preview) {
  return allowed(kKeyTileSkip, preview) && p.key_padding_mask.present();
}

// Whether the flash forward packs the query heads of each key/value head into its tiles' rows
// (flash_fwd_kernel.cuh, kPackGqa): with the preview, under grouped-query heads (G = num_heads /
// num_heads_k > 1, dividing), when the packed G * seqlen_q rows take fewer tiles of block_m rows
// than G heads of seqlen_q rows each, ceil(G * Lq / block_m) < G * ceil(Lq / block_m): the tiles'
// rows are better filled and each K/V tile is streamed by fewer programs (decode, Lq * G <=
// block_m: one program per key/value head instead of G). FlashAttention-3's should_pack_gqa
// compares the same fill ratios. Never when G * seqlen_q would overflow the kernel's int rows.
inline bool pack_gqa(const AttentionParams& p, int block_m, bool preview) {
  if (!allowed(kPackGqa, preview) || !grouped_query(p) || p.num_heads % p.num_heads_k != 0 || block_m <= 0 ||
      p.seqlen_q <= 0) {
    return false;
  }
  const int64_t group = p.num_heads / p.num_heads_k;
  if (group * p.seqlen_q > (int64_t{1} << 30)) {
    return false;
  }
  return (group * p.seqlen_q + block_m - 1) / block_m < group * ((p.seqlen_q + block_m - 1) / block_m);
}

// Whether the flash forward runs 128 query rows a block (FlashFwdTraits kRowTiles 2: each K/V
// fragment read from shared memory feeds two MMAs, and each K/V tile is streamed once for twice
// the rows) instead of 64: with the preview, for prefill-shaped work that the wide kernel is
// compiled for (`compiled`: head-dim tile in kWideFwdHeadDims, neither split nor packed: the
// caller's plan says), where it takes fewer programs than the 64-row kernel (`programs`; with
// seqlen_q <= 64 it takes as many, each with half its rows dead), and only while its programs,
// batch x heads x ceil(seqlen_q / 128), still fill the `sm_count` SMs: with fewer, the 64-row
// kernel's programs keep more SMs busy.
inline bool wide_forward_tiles(bool compiled, int64_t programs, int64_t wide_programs, int sm_count, bool preview) {
  return allowed(kWideForwardTiles, preview) && compiled && sm_count > 0 && wide_programs < programs &&
      wide_programs >= sm_count;
}

// The preview switch's value from the environment variable's text (nullptr when unset): on for "1" only.
inline bool preview_from_env(const char* value) {
  return value != nullptr && value[0] == '1' && value[1] == '\0';
}

// ---- The Hopper (sm_90a) forward: built when the arch list holds 9.0a, never yet run on a GPU.
// It runs only on a compute-capability-9 device with the preview on AND its own switch,
//
//     ATTN_EXPORT_CUDA_SM90=1         read once per process, on the host
//
// so that a preview run of the other features on a Hopper GPU keeps the sm80 forward they were
// written against, and a GPU session can compare the two paths in one build.
inline constexpr const char kSm90EnvVar[] = "ATTN_EXPORT_CUDA_SM90";

inline bool hopper_forward_allowed(int device_major, bool preview, bool sm90_switch) {
  return device_major == 9 && allowed(kHopperForward, preview) && sm90_switch;
}

// ---- The Hopper (sm_90a) backward: built beside the forward, never yet run on a GPU. Same gate:
// a compute-capability-9 device, the preview AND ATTN_EXPORT_CUDA_SM90=1; else the sm80 backward
// runs, behind the same entry point (run_attention_backward).
inline bool hopper_backward_allowed(int device_major, bool preview, bool sm90_switch) {
  return device_major == 9 && allowed(kHopperBackward, preview) && sm90_switch;
}

}  // namespace attn_export::cuda::policy
