// Generic attention kernels on CUDA cores: every dtype (float16, bfloat16, float32, float64),
// any head dims up to kMaxHeadDim (head_dim and head_dim_v may differ), any strides. They
// carry the same semantics as the flash kernels with none of their shape requirements, and
// they compute in the accumulation type throughout (float32 and float64 results match the
// CPU kernels to rounding), which is what float64 gradcheck and odd head dims need.
//
// Still O(L) memory: one warp per query row streams the keys with an online softmax (the
// forward, dQ), or one warp per key row streams the queries (dK, dV); lane l holds head-dim
// elements l, l + 32, ... (kRegs of them) and dot products are warp reductions. The
// attention weights, when asked for, are written by a separate kernel from the saved lse.
#pragma once

#include <cmath>

#include "element.cuh"
#include "kernel_traits.h"
#include "launch.h"

namespace attn_export::cuda {
namespace device {

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

// One row of a [seqlen, dim] matrix into registers: lane l gets elements l, l + 32, ...
template <int kRegs, typename T>
__device__ __forceinline__ void load_row(acc_t<T> (&dst)[kRegs], const T* row, int64_t dim, int lane) {
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int64_t d = lane + 32 * r;
    dst[r] = d < dim ? to_acc(row[d]) : acc_t<T>(0);
  }
}

// The full dot product of a register row with a memory row, in every lane.
template <int kRegs, typename T>
__device__ __forceinline__ acc_t<T> dot_row(const acc_t<T> (&x)[kRegs], const T* row, int64_t dim, int lane) {
  acc_t<T> s = 0;
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int64_t d = lane + 32 * r;
    if (d < dim) {
      s += x[r] * to_acc(row[d]);
    }
  }
  return warp_sum(s);
}

template <int kRegs, typename T>
__device__ __forceinline__ void store_row(T* row, const acc_t<T> (&x)[kRegs], acc_t<T> factor, int64_t dim, int lane) {
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int64_t d = lane + 32 * r;
    if (d < dim) {
      row[d] = from_acc<T>(x[r] * factor);
    }
  }
}

// Which row of which (batch, head) this warp handles; false when past the end.
struct WarpRow {
  int64_t b, h, row;
  int lane;
};

__device__ __forceinline__ WarpRow warp_row() {
  WarpRow w;
  w.lane = threadIdx.x % 32;
  w.row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + threadIdx.x / 32;
  w.h = blockIdx.y;
  w.b = blockIdx.z;
  return w;
}

template <typename T>
__device__ __forceinline__ const T* row_ptr(const void* base, int64_t b, int64_t bs, int64_t h, int64_t hs,
                                            int64_t row, int64_t rs) {
  return static_cast<const T*>(base) + b * bs + h * hs + row * rs;
}

// out and lse for one query row per warp.
template <typename T, int kRegs>
__global__ void __launch_bounds__(kGenericWarps * 32) generic_fwd_kernel(const AttentionParams p) {
  using Acc = acc_t<T>;
  const WarpRow w = warp_row();
  if (w.row >= p.seqlen_q) {
    return;  // the whole warp leaves together: no shuffle misses a lane
  }
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v;
  Acc qv[kRegs];
  load_row<kRegs>(qv, row_ptr<T>(p.q, w.b, p.q_batch_stride, w.h, p.q_head_stride, w.row, p.q_row_stride), dim, w.lane);
  const T* k = row_ptr<T>(p.k, w.b, p.k_batch_stride, p.kv_head(w.h), p.k_head_stride, 0, 0);
  const T* v = row_ptr<T>(p.v, w.b, p.v_batch_stride, p.kv_head(w.h), p.v_head_stride, 0, 0);
  const ScoreMask<Acc> mask(p, w.b, w.h, Acc(1));
  const Alibi<Acc> alibi(p, w.h, Acc(1));
  const SoftCap<Acc> softcap(p);
  const Acc scale = static_cast<Acc>(p.scale);

  Acc o[kRegs] = {};
  Acc row_max = neg_inf<Acc>(), row_sum = 0;
  const int64_t key_end = p.is_causal ? p.causal_key_end(w.row) : p.seqlen_k;
  for (int64_t j = 0; j < key_end; ++j) {
    const Acc s =
        alibi.add(mask.apply(softcap.apply(scale * dot_row<kRegs>(qv, k + j * p.k_row_stride, dim, w.lane)), w.row, j), w.row, j);
    if (s == neg_inf<Acc>()) {
      continue;  // masked (uniform across the warp): contributes nothing
    }
    // Online softmax; row_max = -inf only before the first visible key, where exp(-inf) = 0.
    const Acc new_max = s > row_max ? s : row_max;
    const Acc correction = acc_exp(row_max - new_max);
    const Acc prob = acc_exp(s - new_max);
    row_sum = row_sum * correction + prob;
    const T* v_row = v + j * p.v_row_stride;
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = w.lane + 32 * r;
      o[r] = o[r] * correction + (d < dim_v ? prob * to_acc(v_row[d]) : Acc(0));
    }
    row_max = new_max;
  }

  // A row with no visible key: zero output, lse = -inf.
  const bool visible = row_sum > Acc(0);
  T* out = static_cast<T*>(p.out) + w.b * p.out_batch_stride + w.h * p.out_head_stride + w.row * p.out_row_stride;
  store_row<kRegs>(out, o, visible ? Acc(1) / row_sum : Acc(0), dim_v, w.lane);
  if (w.lane == 0) {
    static_cast<Acc*>(p.lse)[(w.b * p.num_heads + w.h) * p.seqlen_q + w.row] =
        visible ? row_max + acc_log(row_sum) : neg_inf<Acc>();
  }
}

// The attention weights (need_weights=True): weights[b, h, i, j] = exp(s_ij - lse_i), in the
// accumulation type, from the lse the forward wrote. The one unfused kernel: it writes the
// Lq x Lk matrix because that is what was asked for.
template <typename T, int kRegs>
__global__ void __launch_bounds__(kGenericWarps * 32) generic_weights_kernel(const AttentionParams p) {
  using Acc = acc_t<T>;
  const WarpRow w = warp_row();
  if (w.row >= p.seqlen_q) {
    return;
  }
  Acc qv[kRegs];
  load_row<kRegs>(qv, row_ptr<T>(p.q, w.b, p.q_batch_stride, w.h, p.q_head_stride, w.row, p.q_row_stride), p.head_dim, w.lane);
  const T* k = row_ptr<T>(p.k, w.b, p.k_batch_stride, p.kv_head(w.h), p.k_head_stride, 0, 0);
  const ScoreMask<Acc> mask(p, w.b, w.h, Acc(1));
  const Alibi<Acc> alibi(p, w.h, Acc(1));
  const SoftCap<Acc> softcap(p);
  const Acc scale = static_cast<Acc>(p.scale);
  const int64_t bh_row = (w.b * p.num_heads + w.h) * p.seqlen_q + w.row;
  const Acc lse = static_cast<const Acc*>(p.lse)[bh_row];
  Acc* weights = static_cast<Acc*>(p.weights) + bh_row * p.seqlen_k;
  const int64_t key_end = lse == neg_inf<Acc>() ? 0
      : p.is_causal ? p.causal_key_end(w.row) : p.seqlen_k;
  for (int64_t j = 0; j < key_end; ++j) {
    const Acc s = alibi.add(
        mask.apply(softcap.apply(scale * dot_row<kRegs>(qv, k + j * p.k_row_stride, p.head_dim, w.lane)), w.row, j), w.row, j);
    if (w.lane == j % 32) {
      weights[j] = acc_exp(s - lse);  // exp(-inf - finite) = 0 for masked keys
    }
  }
  for (int64_t j = key_end + w.lane; j < p.seqlen_k; j += 32) {
    weights[j] = Acc(0);
  }
}

// delta_i = dO_i . O_i (+ sum_j P_ij gW_ij when the weights have a gradient): the row term of
// the softmax backward, dS_ij = P_ij (dP_ij + gW_ij - delta_i). One warp per query row.
template <typename T, int kRegs>
__global__ void __launch_bounds__(kGenericWarps * 32) generic_delta_kernel(const AttentionBackwardParams p, acc_t<T>* delta) {
  using Acc = acc_t<T>;
  const WarpRow w = warp_row();
  if (w.row >= p.seqlen_q) {
    return;
  }
  Acc dov[kRegs];
  load_row<kRegs>(dov, row_ptr<T>(p.grad_out, w.b, p.grad_out_batch_stride, w.h, p.grad_out_head_stride, w.row, p.grad_out_row_stride), p.head_dim_v, w.lane);
  Acc d = dot_row<kRegs>(dov, row_ptr<T>(p.out, w.b, p.out_batch_stride, w.h, p.out_head_stride, w.row, p.out_row_stride), p.head_dim_v, w.lane);
  const int64_t bh_row = (w.b * p.num_heads + w.h) * p.seqlen_q + w.row;
  const Acc lse = static_cast<const Acc*>(p.lse)[bh_row];
  if (p.grad_weights != nullptr && lse != neg_inf<Acc>()) {
    Acc qv[kRegs];
    load_row<kRegs>(qv, row_ptr<T>(p.q, w.b, p.q_batch_stride, w.h, p.q_head_stride, w.row, p.q_row_stride), p.head_dim, w.lane);
    const T* k = row_ptr<T>(p.k, w.b, p.k_batch_stride, p.kv_head(w.h), p.k_head_stride, 0, 0);
    const Acc* gw = row_ptr<Acc>(p.grad_weights, w.b, p.grad_weights_batch_stride, w.h, p.grad_weights_head_stride, w.row, p.grad_weights_row_stride);
    const ScoreMask<Acc> mask(p, w.b, w.h, Acc(1));
    const Alibi<Acc> alibi(p, w.h, Acc(1));
    const SoftCap<Acc> softcap(p);
    const Acc scale = static_cast<Acc>(p.scale);
    Acc pgw = 0;
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
      const Acc s = alibi.add(
        mask.apply(softcap.apply(scale * dot_row<kRegs>(qv, k + j * p.k_row_stride, p.head_dim, w.lane)), w.row, j), w.row, j);
      if (s != neg_inf<Acc>()) {
        pgw += acc_exp(s - lse) * gw[j];
      }
    }
    d += pgw;
  }
  if (w.lane == 0) {
    delta[bh_row] = d;
  }
}

// dK and dV for one key row per warp: sums over the queries that see the key.
template <typename T, int kRegs>
__global__ void __launch_bounds__(kGenericWarps * 32) generic_bwd_dkdv_kernel(const AttentionBackwardParams p, const acc_t<T>* delta) {
  using Acc = acc_t<T>;
  const WarpRow w = warp_row();  // w.row is a key here
  if (w.row >= p.seqlen_k) {
    return;
  }
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v, key = w.row;
  Acc kv[kRegs], vv[kRegs];
  load_row<kRegs>(kv, row_ptr<T>(p.k, w.b, p.k_batch_stride, p.kv_head(w.h), p.k_head_stride, key, p.k_row_stride), dim, w.lane);
  load_row<kRegs>(vv, row_ptr<T>(p.v, w.b, p.v_batch_stride, p.kv_head(w.h), p.v_head_stride, key, p.v_row_stride), dim_v, w.lane);
  const T* q = row_ptr<T>(p.q, w.b, p.q_batch_stride, w.h, p.q_head_stride, 0, 0);
  const T* dout = row_ptr<T>(p.grad_out, w.b, p.grad_out_batch_stride, w.h, p.grad_out_head_stride, 0, 0);
  const int64_t bh = w.b * p.num_heads + w.h;
  const Acc* lse = static_cast<const Acc*>(p.lse) + bh * p.seqlen_q;
  const Acc* delta_bh = delta + bh * p.seqlen_q;
  const Acc* gw = p.grad_weights == nullptr ? nullptr
      : row_ptr<Acc>(p.grad_weights, w.b, p.grad_weights_batch_stride, w.h, p.grad_weights_head_stride, 0, 0);
  const ScoreMask<Acc> mask(p, w.b, w.h, Acc(1));
  const Alibi<Acc> alibi(p, w.h, Acc(1));
  const SoftCap<Acc> softcap(p);
  const Acc scale = static_cast<Acc>(p.scale);

  Acc dk[kRegs] = {}, dv[kRegs] = {};
  // Causality: query i sees the key from i = key - causal_shift() on.
  const int64_t first_query = p.is_causal && key > p.causal_shift() ? key - p.causal_shift() : 0;
  for (int64_t i = first_query; i < p.seqlen_q; ++i) {
    if (lse[i] == neg_inf<Acc>()) {
      continue;  // a fully masked query row: zero probabilities, zero gradient
    }
    const T* q_row = q + i * p.q_row_stride;
    const Acc x = scale * dot_row<kRegs>(kv, q_row, dim, w.lane);
    const Acc s = alibi.add(mask.apply(softcap.apply(x), i, key), i, key);
    if (s == neg_inf<Acc>()) {
      continue;
    }
    const Acc prob = acc_exp(s - lse[i]);
    const T* do_row = dout + i * p.grad_out_row_stride;
    Acc dp = dot_row<kRegs>(vv, do_row, dim_v, w.lane);
    if (gw != nullptr) {
      dp += gw[i * p.grad_weights_row_stride + key];
    }
    const Acc ds = prob * (dp - delta_bh[i]) * softcap.grad(x);
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = w.lane + 32 * r;
      if (d < dim_v) {
        dv[r] += prob * to_acc(do_row[d]);
      }
      if (d < dim) {
        dk[r] += ds * to_acc(q_row[d]);
      }
    }
  }
  store_row<kRegs>(static_cast<T*>(p.grad_k) + w.b * p.grad_k_batch_stride + w.h * p.grad_k_head_stride + key * p.grad_k_row_stride, dk, scale, dim, w.lane);
  store_row<kRegs>(static_cast<T*>(p.grad_v) + w.b * p.grad_v_batch_stride + w.h * p.grad_v_head_stride + key * p.grad_v_row_stride, dv, Acc(1), dim_v, w.lane);
}

// dQ for one query row per warp: a sum over the keys it sees. A second pass over (query, key)
// pairs instead of atomics from the dK/dV pass: deterministic, and no float64 atomics.
template <typename T, int kRegs>
__global__ void __launch_bounds__(kGenericWarps * 32) generic_bwd_dq_kernel(const AttentionBackwardParams p, const acc_t<T>* delta) {
  using Acc = acc_t<T>;
  const WarpRow w = warp_row();
  if (w.row >= p.seqlen_q) {
    return;
  }
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v;
  const int64_t bh_row = (w.b * p.num_heads + w.h) * p.seqlen_q + w.row;
  const Acc lse = static_cast<const Acc*>(p.lse)[bh_row];
  Acc qv[kRegs], dov[kRegs];
  load_row<kRegs>(qv, row_ptr<T>(p.q, w.b, p.q_batch_stride, w.h, p.q_head_stride, w.row, p.q_row_stride), dim, w.lane);
  load_row<kRegs>(dov, row_ptr<T>(p.grad_out, w.b, p.grad_out_batch_stride, w.h, p.grad_out_head_stride, w.row, p.grad_out_row_stride), dim_v, w.lane);
  const T* k = row_ptr<T>(p.k, w.b, p.k_batch_stride, p.kv_head(w.h), p.k_head_stride, 0, 0);
  const T* v = row_ptr<T>(p.v, w.b, p.v_batch_stride, p.kv_head(w.h), p.v_head_stride, 0, 0);
  const Acc* gw = p.grad_weights == nullptr ? nullptr
      : row_ptr<Acc>(p.grad_weights, w.b, p.grad_weights_batch_stride, w.h, p.grad_weights_head_stride, w.row, p.grad_weights_row_stride);
  const ScoreMask<Acc> mask(p, w.b, w.h, Acc(1));
  const Alibi<Acc> alibi(p, w.h, Acc(1));
  const SoftCap<Acc> softcap(p);
  const Acc scale = static_cast<Acc>(p.scale);
  const Acc row_delta = delta[bh_row];

  Acc dq[kRegs] = {};
  const int64_t key_end = lse == neg_inf<Acc>() ? 0
      : p.is_causal ? p.causal_key_end(w.row) : p.seqlen_k;
  for (int64_t j = 0; j < key_end; ++j) {
    const T* k_row = k + j * p.k_row_stride;
    const Acc x = scale * dot_row<kRegs>(qv, k_row, dim, w.lane);
    const Acc s = alibi.add(mask.apply(softcap.apply(x), w.row, j), w.row, j);
    if (s == neg_inf<Acc>()) {
      continue;
    }
    const Acc prob = acc_exp(s - lse);
    Acc dp = dot_row<kRegs>(dov, v + j * p.v_row_stride, dim_v, w.lane);
    if (gw != nullptr) {
      dp += gw[j];
    }
    const Acc ds = prob * (dp - row_delta) * softcap.grad(x);
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = w.lane + 32 * r;
      if (d < dim) {
        dq[r] += ds * to_acc(k_row[d]);
      }
    }
  }
  store_row<kRegs>(static_cast<T*>(p.grad_q) + w.b * p.grad_q_batch_stride + w.h * p.grad_q_head_stride + w.row * p.grad_q_row_stride, dq, scale, dim, w.lane);
}

}  // namespace device

inline dim3 generic_grid(int64_t rows, const AttentionParams& p) {
  return dim3(static_cast<unsigned>((rows + kGenericWarps - 1) / kGenericWarps), static_cast<unsigned>(p.num_heads),
              static_cast<unsigned>(p.batch));
}

// Host launchers, instantiated per dtype and kRegs in generic_*.cu.
template <typename T, int kRegs>
cudaError_t run_generic_fwd(const AttentionParams& p, cudaStream_t stream) {
  return launch_kernel(device::generic_fwd_kernel<T, kRegs>, generic_grid(p.seqlen_q, p),
                       dim3(kGenericWarps * 32), 0, stream, p);
}

// After either forward (it reads the lse the forward wrote).
template <typename T, int kRegs>
cudaError_t run_generic_weights(const AttentionParams& p, cudaStream_t stream) {
  return launch_kernel(device::generic_weights_kernel<T, kRegs>, generic_grid(p.seqlen_q, p),
                       dim3(kGenericWarps * 32), 0, stream, p);
}

template <typename T, int kRegs>
cudaError_t run_generic_delta(const AttentionBackwardParams& p, acc_t<T>* delta, cudaStream_t stream) {
  return launch_kernel(device::generic_delta_kernel<T, kRegs>, generic_grid(p.seqlen_q, p),
                       dim3(kGenericWarps * 32), 0, stream, p, delta);
}

template <typename T, int kRegs>
cudaError_t run_generic_bwd(const AttentionBackwardParams& p, const acc_t<T>* delta, cudaStream_t stream) {
  cudaError_t err = launch_kernel(device::generic_bwd_dkdv_kernel<T, kRegs>, generic_grid(p.seqlen_k, p),
                                  dim3(kGenericWarps * 32), 0, stream, p, delta);
  if (err == cudaSuccess) {
    err = launch_kernel(device::generic_bwd_dq_kernel<T, kRegs>, generic_grid(p.seqlen_q, p),
                        dim3(kGenericWarps * 32), 0, stream, p, delta);
  }
  return err;
}

// The explicit instantiations of one element type and register count (generic_kernels.cu).
#define ATTN_EXPORT_GENERIC_KERNELS(T, R)                                                                    \
  template cudaError_t run_generic_fwd<T, R>(const AttentionParams&, cudaStream_t);                          \
  template cudaError_t run_generic_weights<T, R>(const AttentionParams&, cudaStream_t);                      \
  template cudaError_t run_generic_delta<T, R>(const AttentionBackwardParams&, acc_t<T>*, cudaStream_t);     \
  template cudaError_t run_generic_bwd<T, R>(const AttentionBackwardParams&, const acc_t<T>*, cudaStream_t);

}  // namespace attn_export::cuda
