// Which tiles a block can see: the causal diagonal's and the sliding window's bounds on the key
// tiles of a block of queries (forward) and on the query blocks of a block of keys (backward),
// and whether a visited tile needs the per-score mask. Every flash kernel walks these bounds —
// the sm80 forward and backward, both Hopper kernels, and their CPU emulation (the emulator
// compiles this header as plain C++) — so one definition keeps them skipping the same tiles.
//
// Semantics are AttentionParams' (attention_params.h): under causality query i sees keys
// [causal_key_begin(i), causal_key_end(i)), i.e. j <= i + causal_shift() and, with a window,
// j > i + causal_shift() - window. The bounds only skip tiles that are masked entirely; the mask
// (ScoreMask, element.cuh) stays the source of truth for every score of a visited tile.
// Model: FlashAttention's hopper/block.h.
#pragma once

#include <cstdint>

#include "../../attention_params.h"

namespace attn_export::cuda::bounds {

// Tiles [begin, end); empty when begin >= end.
struct TileRange {
  int begin = 0, end = 0;
};

// How many tiles of kBlock rows hold `count` rows.
template <int kBlock>
ATTN_EXPORT_HOST_DEVICE inline int tiles_of(int64_t count) {
  return static_cast<int>((count + kBlock - 1) / kBlock);
}

// The key tiles (kBlockN keys each) that any of the queries [first_query, last_query] can see:
// none past the last query's diagonal, none wholly before the first query's window (its start
// grows with the query). Without causality, every key tile.
template <int kBlockN, bool kIsCausal>
ATTN_EXPORT_HOST_DEVICE inline TileRange key_tiles(const AttentionParams& p, int64_t first_query,
                                                   int64_t last_query) {
  if constexpr (!kIsCausal) {
    return {0, tiles_of<kBlockN>(p.seqlen_k)};
  }
  const int end = tiles_of<kBlockN>(p.causal_key_end(last_query));
  const int begin = static_cast<int>(p.causal_key_begin(first_query) / kBlockN);
  return {begin < end ? begin : end, end};
}

// The query blocks (kBlockM queries each) from which some query can see a key of the block
// [n0, n0 + kBlockN): from the first query whose diagonal reaches n0 (query i sees keys
// j <= i + shift), to the last query whose window still reaches the block's last key (query i sees
// key j only while i < j - shift + window). Both bounds are non-decreasing in n0 (the Hopper
// backward's deterministic dQ order relies on it). Empty (begin >= end) when no query sees any.
template <int kBlockM, int kBlockN, bool kIsCausal>
ATTN_EXPORT_HOST_DEVICE inline TileRange query_blocks(const AttentionParams& p, int n0) {
  const int64_t seqlen_q = p.seqlen_q;
  if constexpr (!kIsCausal) {
    return {0, tiles_of<kBlockM>(seqlen_q)};
  }
  const int64_t first = n0 - p.causal_shift();
  int64_t end = seqlen_q;
  if (p.window > 0) {
    const int64_t last_key = (n0 + kBlockN < p.seqlen_k ? n0 + kBlockN : p.seqlen_k) - 1;
    const int64_t window_end = last_key - p.causal_shift() + p.window;
    end = window_end <= 0 ? 0 : (window_end < seqlen_q ? window_end : seqlen_q);
  }
  return {first <= 0 ? 0 : static_cast<int>(first / kBlockM), tiles_of<kBlockM>(end)};
}

// Whether the sliding window hides key `col` from query `row` (and so, the window's start growing
// with the row, some key from col on from some query up to row): with col a tile's first key and
// row its last query, whether the window cuts into the tile. shift: the kernel's causal shift.
// Read from the kernel parameters at each use, so that it holds no registers in tight loops.
ATTN_EXPORT_HOST_DEVICE inline bool window_hides(const AttentionParams& p, int row, int col, int shift) {
  return p.window > 0 && col <= row + shift - p.window;
}

// Whether causality can hide a score of the tile of keys [n0, n0 + block_n) for the queries
// [first_query, last_query]: the diagonal of its first query, or the window of its last one.
ATTN_EXPORT_HOST_DEVICE inline bool causal_edge_in_tile(const AttentionParams& p, int first_query, int last_query,
                                                        int n0, int block_n, int shift) {
  return n0 + block_n - 1 > first_query + shift || window_hides(p, last_query, n0, shift);
}

}  // namespace attn_export::cuda::bounds
