// Padded batches at the cost of their tokens: the key tiles a key-padding mask leaves visible.
//
// When AttentionParams::skip_padded_key_tiles is set (the dispatch sets it under the preview
// switch, dispatch_policy.h kKeyTileSkip), a program first finds the first and the last key of
// its batch row that the key-padding mask leaves visible (bool: zero; additive: not -inf), in
// one pass of the block's threads over its keys of the mask row, and clamps its key-tile loop to
// the tiles holding them. Contiguous padding, left or right (the deployment case), is then never
// loaded nor computed. Keys between the first and the last visible one (interior holes) are still
// masked one by one by ScoreMask, so correctness never depends on the padding being contiguous.
//
// No workspace and no extra launch: the pass reads the program's keys of the mask row (bytes,
// shared through L2 by every head and query tile of the row), against the keys x head dim x 4
// bytes of K and V that a skipped tile saves.
#pragma once

#include "block_bounds.h"
#include "element.cuh"

namespace attn_export::cuda::device {

// Whether key `key` of batch row `b` is padded by the key-padding mask (present).
__device__ __forceinline__ bool key_padded(const AttentionMask& m, int64_t b, int64_t key) {
  const int64_t at = b * m.batch_stride + key * m.col_stride;
  if (m.kind == MaskKind::kBool) {
    return static_cast<const uint8_t*>(m.ptr)[at] != 0;
  }
  return load_additive<float>(m.ptr, at, m.dtype) == neg_inf<float>();
}

// The tiles of [tile_begin, tile_end) that hold a key of batch row `b` the key-padding mask
// leaves visible: [tile of the first visible key, tile of the last one]; all of them when
// skipping is off or there is no key-padding mask. `scratch`: two ints of shared memory that no
// copy in flight writes. Every thread of the block must call it (it synchronizes the block).
template <int kBlockN, int kNThreads>
__device__ bounds::TileRange key_tile_range(const AttentionParams& p, int64_t b, int tile_begin, int tile_end, int* scratch) {
  if (!p.skip_padded_key_tiles || !mask_present(p.key_padding_mask) || tile_begin >= tile_end) {
    return {tile_begin, tile_end};
  }
  const int key_begin = tile_begin * kBlockN;
  const int key_end = imin(static_cast<int>(p.seqlen_k), tile_end * kBlockN);
  int first = key_end, last = key_begin - 1;
  for (int key = key_begin + static_cast<int>(threadIdx.x); key < key_end; key += kNThreads) {
    if (!key_padded(p.key_padding_mask, b, key)) {
      first = imin(first, key);
      last = key;  // each thread's keys ascend
    }
  }
  if (threadIdx.x == 0) {
    scratch[0] = key_end;
    scratch[1] = key_begin - 1;
  }
  __syncthreads();
  if (first <= last) {
    atomicMin(scratch, first);
    atomicMax(scratch + 1, last);
  }
  __syncthreads();
  first = scratch[0];
  last = scratch[1];
  __syncthreads();  // every thread has read scratch before the caller reuses that memory
  if (first > last) {
    return {tile_begin, tile_begin};  // no visible key: no tile
  }
  return {first / kBlockN, last / kBlockN + 1};
}

}  // namespace attn_export::cuda::device
