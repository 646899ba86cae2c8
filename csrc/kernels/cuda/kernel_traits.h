// Tile sizes of the flash (tensor-core) kernels, in one place per head dim.
//
// Each warp owns one 16-row MMA tile: in the forward, 16 query rows (so a block covers
// kBlockM = 16 * kNWarps queries and streams keys kBlockN at a time); in the backward, 16 key
// rows (a block owns kBlockN = 16 * kNWarps keys and streams queries kBlockM at a time).
// Shared-memory rows are padded by 8 elements (16 bytes): rows stay 16-byte aligned for
// cp.async and ldmatrix, and the 8 row addresses of one ldmatrix phase fall on distinct banks.
//
// These are first choices, made without a GPU at hand (register budgets counted by hand: the
// D=128 backward keeps dK, dV, S, dP and a dQ slice, ~190 floats per thread); tuning them on
// sm_80 / sm_90 is a change of this file only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn_export::cuda {

// Accumulation type: float for float16, bfloat16 and float32, double for float64.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulator<T>::type;

inline constexpr int kSmemPad = 8;

template <int kHeadDim_>
struct FlashFwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockM = 16 * kNWarps;
  static constexpr int kBlockN = kHeadDim <= 32 ? 128 : 64;
  static constexpr int kRowStride = kHeadDim + kSmemPad;  // of sQ, sK, sV, in elements

  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0);

  // sQ [kBlockM][kRowStride], sK and sV [kBlockN][kRowStride].
  template <typename Element>
  static constexpr size_t smem_bytes() {
    return sizeof(Element) * static_cast<size_t>(kBlockM + 2 * kBlockN) * kRowStride;
  }
};

template <int kHeadDim_>
struct FlashBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockN = 16 * kNWarps;          // keys owned by a block
  static constexpr int kBlockM = kHeadDim <= 64 ? 64 : 32;  // queries per step
  static constexpr int kRowStride = kHeadDim + kSmemPad;   // of sK, sV, sQ, sdO
  static constexpr int kDsRowStride = kBlockN + kSmemPad;  // of sdS [kBlockM][kBlockN]
  // dQ = dS K is split over the warps as a kDqWarpsM x kDqWarpsN grid of 16 x kDqCols tiles.
  static constexpr int kDqWarpsM = kBlockM / 16;
  static constexpr int kDqWarpsN = kNWarps / kDqWarpsM;
  static constexpr int kDqCols = kHeadDim / kDqWarpsN;

  static_assert(kHeadDim % 16 == 0 && kBlockM % 16 == 0);
  static_assert(kDqWarpsM * kDqWarpsN == kNWarps && kDqCols % 16 == 0);

  // sK, sV [kBlockN][kRowStride]; sQ, sdO double-buffered [2][kBlockM][kRowStride];
  // sdS [kBlockM][kDsRowStride]; then floats: lse and delta, double-buffered [2][kBlockM] each.
  template <typename Element>
  static constexpr size_t smem_elements_bytes() {
    return sizeof(Element) *
        (static_cast<size_t>(2 * kBlockN + 4 * kBlockM) * kRowStride +
         static_cast<size_t>(kBlockM) * kDsRowStride);
  }
  template <typename Element>
  static constexpr size_t smem_bytes() {
    return smem_elements_bytes<Element>() + sizeof(float) * 4 * kBlockM;
  }
};

// The generic (CUDA-core) kernels: one warp per query row (forward, dQ) or key row (dK, dV);
// lane l holds elements l, l + 32, ... of the head dim, kRegs of them.
inline constexpr int kGenericWarps = 4;

}  // namespace attn_export::cuda
