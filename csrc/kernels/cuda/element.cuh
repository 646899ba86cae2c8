// Element types, conversions and score masking shared by every attention kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../attention_params.h"
#include "kernel_traits.h"

namespace attn_export::cuda::device {

__host__ __device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ constexpr int iabs(int a) { return a < 0 ? -a : a; }

template <typename Acc>
__host__ __device__ __forceinline__ constexpr Acc neg_inf() {
  return static_cast<Acc>(-INFINITY);
}

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return x;
  }
}

// Two floats rounded to a 16-bit type and packed into one 32-bit register, `lo` in the low
// half: the operand format of mma.sync and of a 4-byte store of two adjacent elements.
template <typename Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Element, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  }
  return bits;
}

// One element of an additive mask, whatever its floating dtype.
template <typename Acc>
__device__ __forceinline__ Acc load_additive(const void* base, int64_t offset, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
      return static_cast<Acc>(__half2float(static_cast<const __half*>(base)[offset]));
    case DataType::kBFloat16:
      return static_cast<Acc>(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[offset]));
    case DataType::kFloat64:
      return static_cast<Acc>(static_cast<const double*>(base)[offset]);
    case DataType::kFloat32:
    default:
      return static_cast<Acc>(static_cast<const float*>(base)[offset]);
  }
}

__device__ __forceinline__ float acc_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }

// Logit soft-capping (AttentionParams::softcap) of a scaled score x: softcap * tanh(x / softcap)
// when softcap > 0, x otherwise; applied before the masks, so a -inf mask still removes a key.
// `on` is uniform across the grid: kernels test it once and keep the uncapped path as it was.
template <typename Acc>
struct SoftCap {
  Acc cap = 0, inv_cap = 0;
  bool on = false;

  __device__ explicit SoftCap(const AttentionParams& p)
      : cap(static_cast<Acc>(p.softcap)),
        inv_cap(p.softcap > 0 ? static_cast<Acc>(1.0 / p.softcap) : Acc(0)),
        on(p.softcap > 0) {}

  // tanh(x / softcap): the capped score is cap * t, its derivative with respect to x 1 - t^2.
  __device__ __forceinline__ Acc tanh_of(Acc x) const { return acc_tanh(x * inv_cap); }
  __device__ __forceinline__ Acc apply(Acc x) const { return on ? cap * tanh_of(x) : x; }
  __device__ __forceinline__ Acc grad(Acc x) const {
    if (!on) {
      return Acc(1);
    }
    const Acc t = tanh_of(x);
    return Acc(1) - t * t;
  }
};

// ALiBi (AttentionParams::alibi_slopes): -slope[h] * |row + seqlen_k - seqlen_q - col|, added after
// the soft-cap, with the masks (a -inf score stays -inf). `on` is uniform across the grid, like
// SoftCap's: a kernel tests it where it tests the soft-cap and computes nothing more without slopes.
// `domain` multiplies the slope: 1 for natural-log scores, log2(e) for the flash kernels'.
template <typename Acc>
struct Alibi {
  Acc slope = 0;           // of the program's head, times `domain`; 0 when off
  int64_t diagonal = 0;    // seqlen_k - seqlen_q: query i's distance from key j is |i + diagonal - j|
  bool on = false;

  __device__ Alibi(const AttentionParams& p, int64_t h, Acc domain)
      : slope(p.alibi_slopes != nullptr ? domain * static_cast<Acc>(p.alibi_slopes[h]) : Acc(0)),
        diagonal(p.seqlen_k - p.seqlen_q),
        on(p.alibi_slopes != nullptr) {}

  // The distance of query `row` from key `col`, as an Acc.
  __device__ __forceinline__ Acc distance(int64_t row, int64_t col) const {
    const int64_t d = row + diagonal - col;
    return static_cast<Acc>(d < 0 ? -d : d);
  }
  // `s` with the bias of query `row` and key `col` of the program's head (unchanged when off).
  __device__ __forceinline__ Acc add(Acc s, int64_t row, int64_t col) const {
    return on ? s - slope * distance(row, col) : s;
  }
};

// AttentionMask::present(), callable from device code (attention_params.h is plain C++).
__device__ __forceinline__ bool mask_present(const AttentionMask& m) {
  return m.kind != MaskKind::kNone && m.ptr != nullptr;
}

// Every mask of one (batch, head) slice, applied to one score at a time. Out-of-range rows
// and columns (the padding of a partial tile) are masked too, so that a tile's padding
// contributes exactly zero probability in the forward and the backward alike.
template <typename Acc>
struct ScoreMask {
  const void* attn = nullptr;
  MaskKind attn_kind = MaskKind::kNone;
  DataType attn_dtype = DataType::kFloat32;
  int64_t attn_offset = 0, attn_row_stride = 0, attn_col_stride = 0;
  const void* pad = nullptr;
  MaskKind pad_kind = MaskKind::kNone;
  DataType pad_dtype = DataType::kFloat32;
  int64_t pad_offset = 0, pad_col_stride = 0;
  int64_t seqlen_q = 0, seqlen_k = 0;
  bool causal = false;
  int64_t causal_shift = 0;  // query i sees keys j <= i + causal_shift (attention_params.h)
  int64_t window = 0;        // > 0 (with causal): and keys j > i + causal_shift - window only
  // Multiplies additive mask values: 1 for natural-log scores, log2(e) for the flash
  // kernels, whose scores are kept in the log2 domain.
  Acc mask_scale = 1;

  // with_window false: the caller applies the window itself (the flash backward reads it from the
  // kernel parameters, so that it holds no registers in its tight loops: bounds::window_hides; the
  // flash forward spills the other way round, with the window outside the mask).
  __device__ ScoreMask(const AttentionParams& p, int64_t b, int64_t h, Acc scale_of_mask, bool with_window = true)
      : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), causal(p.is_causal), causal_shift(p.causal_shift()),
        window(with_window && p.is_causal ? p.window : 0), mask_scale(scale_of_mask) {
    if (mask_present(p.attn_mask)) {
      attn = p.attn_mask.ptr;
      attn_kind = p.attn_mask.kind;
      attn_dtype = p.attn_mask.dtype;
      attn_offset = b * p.attn_mask.batch_stride + h * p.attn_mask.head_stride;
      attn_row_stride = p.attn_mask.row_stride;
      attn_col_stride = p.attn_mask.col_stride;
    }
    if (mask_present(p.key_padding_mask)) {
      pad = p.key_padding_mask.ptr;
      pad_kind = p.key_padding_mask.kind;
      pad_dtype = p.key_padding_mask.dtype;
      pad_offset = b * p.key_padding_mask.batch_stride;
      pad_col_stride = p.key_padding_mask.col_stride;
    }
  }

  // Whether any mask tensor must be read (causality and bounds are arithmetic).
  __device__ __forceinline__ bool reads_memory() const { return attn != nullptr || pad != nullptr; }

  // Whether the sliding window hides key col from query last_row, and so (its start grows with
  // the row) some key from col on from some query up to last_row: with col a tile's first key
  // and last_row its last query, whether the tile needs the mask.
  __device__ __forceinline__ bool window_reaches(int64_t last_row, int64_t col) const {
    return window > 0 && col <= last_row + causal_shift - window;
  }

  // `s` with the masks of query `row` and key `col` applied: -inf where attending is not allowed.
  __device__ __forceinline__ Acc apply(Acc s, int64_t row, int64_t col) const {
    return apply_at(s, row, col, row * attn_row_stride);
  }

  // apply() with the attention mask's row given as an offset from this slice's start: a packed
  // grouped-query tile (flash_fwd_kernel.cuh) holds rows of the slice's head and of the next ones.
  __device__ __forceinline__ Acc apply_at(Acc s, int64_t row, int64_t col, int64_t attn_row) const {
    if (row >= seqlen_q || col >= seqlen_k || (causal && col > row + causal_shift) || window_reaches(row, col)) {
      return neg_inf<Acc>();
    }
    if (attn != nullptr) {
      const int64_t at = attn_offset + attn_row + col * attn_col_stride;
      if (attn_kind == MaskKind::kBool) {
        if (static_cast<const uint8_t*>(attn)[at] != 0) {
          return neg_inf<Acc>();
        }
      } else {
        s += mask_scale * load_additive<Acc>(attn, at, attn_dtype);
      }
    }
    if (pad != nullptr) {
      const int64_t at = pad_offset + col * pad_col_stride;
      if (pad_kind == MaskKind::kBool) {
        if (static_cast<const uint8_t*>(pad)[at] != 0) {
          return neg_inf<Acc>();
        }
      } else {
        s += mask_scale * load_additive<Acc>(pad, at, pad_dtype);
      }
    }
    return s;
  }
};

}  // namespace attn_export::cuda::device
