// Flash backward (FlashAttention-2 style) on tensor cores, float16/bfloat16 with float32
// accumulation. Three steps, all O(L) in extra memory:
//
//   1. delta_i = dO_i . O_i (+ sum_j P_ij gW_ij when the weights have a gradient): the row
//      term of the softmax backward, computed by generic_delta_kernel (generic_kernels.cuh).
//   2. flash_bwd_kernel: one block per (batch, head, block of kBlockN keys). It keeps that
//      block's K and V in shared memory, and its dK and dV in registers, and streams the query
//      blocks that can see those keys. Per query block it recomputes P from Q, K and the saved
//      log-sum-exp (never storing P), then
//          dV += P^T dO,   dP = dO V^T (+ gW),   dS = P * (dP - delta) (* (1 - t^2) with
//                                                 a soft-cap, t = tanh(scale q.k / softcap)),
//          dK += dS^T Q,   dQ += dS K  (float atomics into a workspace; many key blocks add
//                                       to the same query rows).
//      Each warp owns 16 key rows, so it computes S^T = K Q^T and dP^T = V dO^T directly: their
//      accumulators are already the A operands of dV += P^T dO and dK += dS^T Q. dQ needs dS
//      row-major by query, so dS^T goes through shared memory once. Above head dim 96, two
//      warps own the same 16 keys, each the dK and dV of half the head dim (kColSplit).
//   3. flash_bwd_dq_kernel: dQ = scale * accumulated dQ, converted to the element type.
#pragma once

#include "block_bounds.h"
#include "device_primitives.cuh"
#include "element.cuh"
#include "flash_fwd_kernel.cuh"
#include "kernel_traits.h"
#include "key_tile_range.cuh"
#include "launch.h"

namespace attn_export::cuda {
namespace device {

template <typename Traits, typename Element, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_kernel(const AttentionBackwardParams params, float* __restrict__ dq_accum,
                     const float* __restrict__ delta) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kD = Traits::kHeadDim, kBM = Traits::kBlockM, kBN = Traits::kBlockN;
  constexpr int kRS = Traits::kRowStride, kDsRS = Traits::kDsRowStride, kNT = Traits::kNThreads;
  constexpr int kQTiles = kBM / 8;  // 8-column accumulator tiles of one warp's S^T, dP^T
  constexpr int kDTiles = Traits::kColsPerWarp / 8;  // ... and of its dK, dV columns
  constexpr int kDqTiles = Traits::kDqCols / 8;

  Element* sK = shared_memory<Element>();
  Element* sV = sK + kBN * kRS;
  Element* sQ = sV + kBN * kRS;      // [2][kBM][kRS]
  Element* sdO = sQ + 2 * kBM * kRS;  // [2][kBM][kRS]
  Element* sdS = sdO + 2 * kBM * kRS;  // [kBM][kDsRS]: dS, row-major by query
  float* sLse = reinterpret_cast<float*>(shared_memory<unsigned char>() +
                                         Traits::template smem_elements_bytes<Element>());  // [2][kBM]
  float* sDelta = sLse + 2 * kBM;                                                           // [2][kBM]

  const int n0 = blockIdx.x * kBN;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = b * params.num_heads + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The warp's 16 keys, and its share of dK and dV's columns (from col0 on).
  const int key_warp = warp % Traits::kKeyWarps, col0 = (warp / Traits::kKeyWarps) * Traits::kColsPerWarp;
  const int seqlen_q = static_cast<int>(params.seqlen_q), seqlen_k = static_cast<int>(params.seqlen_k);
  const int dim = static_cast<int>(params.head_dim), dim_v = static_cast<int>(params.head_dim_v);

  const Element* q = static_cast<const Element*>(params.q) + b * params.q_batch_stride + h * params.q_head_stride;
  const int64_t kv = params.kv_head(h);  // grouped-query attention: dK/dV are per query head (binding sums)
  const Element* k = static_cast<const Element*>(params.k) + b * params.k_batch_stride + kv * params.k_head_stride;
  const Element* v = static_cast<const Element*>(params.v) + b * params.v_batch_stride + kv * params.v_head_stride;
  const Element* dout = static_cast<const Element*>(params.grad_out) + b * params.grad_out_batch_stride +
      h * params.grad_out_head_stride;
  const float* lse = static_cast<const float*>(params.lse) + bh * seqlen_q;
  const float* delta_bh = delta + bh * seqlen_q;
  float* dq_bh = dq_accum + bh * seqlen_q * dim;  // [seqlen_q][dim]: the padding is not accumulated
  const float* grad_weights = params.grad_weights == nullptr
      ? nullptr
      : static_cast<const float*>(params.grad_weights) + b * params.grad_weights_batch_stride +
          h * params.grad_weights_head_stride;

  // Causal: the query blocks from which some query sees a key of this block (block_bounds.h):
  // none before the diagonal reaches n0, none past the last query whose window reaches the
  // block's last key (the per-element window below still masks the blocks visited).
  const int shift = kIsCausal ? static_cast<int>(params.causal_shift()) : 0;
  const bounds::TileRange seen_by = bounds::query_blocks<kBM, kBN, kIsCausal>(params, n0);
  const int m_begin = seen_by.begin, m_blocks = seen_by.end;
  // A block whose keys the padding mask pads entirely: dK = dV = 0, and nothing for dQ (sK is free yet).
  const bounds::TileRange own = key_tile_range<kBN, kNT>(params, b, n0 / kBN, n0 / kBN + 1, reinterpret_cast<int*>(sK));

  // Query block m into buffer `buf`: Q and dO by cp.async; lse (log2 domain) and delta by
  // plain loads. A row without any visible key (lse = -inf), and the padding rows of a
  // partial block, get lse = +inf so that every exp2(s - lse) is exactly 0.
  auto load_query_block = [&](int m, int buf) {
    const int m0 = m * kBM;
    load_tile_async<kBM, kD, kRS, kNT>(sQ + buf * kBM * kRS, q, params.q_row_stride, m0, seqlen_q, dim);
    load_tile_async<kBM, kD, kRS, kNT>(sdO + buf * kBM * kRS, dout, params.grad_out_row_stride, m0, seqlen_q, dim_v);
    for (int i = threadIdx.x; i < kBM; i += kNT) {
      const int row = m0 + i;
      const float l = row < seqlen_q ? lse[row] : neg_inf<float>();
      sLse[buf * kBM + i] = l == neg_inf<float>() ? INFINITY : l * kLog2e;
      sDelta[buf * kBM + i] = row < seqlen_q ? delta_bh[row] : 0.f;
    }
  };

  // This thread's key rows of the warp's 16: r = 0 -> key_a, r = 1 -> key_a + 8.
  const int key_a = n0 + key_warp * 16 + lane / 4;
  const int col_in_tile = (lane % 4) * 2;
  const float scale_log2 = static_cast<float>(params.scale) * kLog2e;
  const ScoreMask<float> mask(params, b, h, kLog2e, /*with_window=*/false);
  const SoftCap<float> softcap(params);
  // ALiBi (element.cuh Alibi): head h's slope in the log2 domain; nothing is read without slopes.
  const bool alibi_on = params.alibi_slopes != nullptr;
  const float alibi_slope = alibi_on ? params.alibi_slopes[h] * kLog2e : 0.f;
  const int alibi_diagonal = seqlen_k - seqlen_q;

  float acc_dk[kDTiles][4] = {};
  float acc_dv[kDTiles][4] = {};

  if (m_begin < m_blocks && own.begin < own.end) {  // else no query sees these keys: dK = dV = 0
    load_tile_async<kBN, kD, kRS, kNT>(sK, k, params.k_row_stride, n0, seqlen_k, dim);
    load_tile_async<kBN, kD, kRS, kNT>(sV, v, params.v_row_stride, n0, seqlen_k, dim_v);
    load_query_block(m_begin, 0);
    cp_async_commit();

    for (int m = m_begin; m < m_blocks; ++m) {
      const int buf = (m - m_begin) % 2;
      const int m0 = m * kBM;
      cp_async_wait<0>();
      __syncthreads();  // query block m is in buffer `buf`; every warp is done with iteration m-1
      // Prefetch the next query block into the other buffer (last read in iteration m-1).
      if (m + 1 < m_blocks) {
        load_query_block(m + 1, buf ^ 1);
      }
      cp_async_commit();

      const Element* cQ = sQ + buf * kBM * kRS;
      const Element* cdO = sdO + buf * kBM * kRS;
      const float* cLse = sLse + buf * kBM;
      const float* cDelta = sDelta + buf * kBM;

      // S^T = K Q^T and dP^T = V dO^T: the warp's 16 keys x kBM queries.
      float acc_s[kQTiles][4] = {};
      float acc_dp[kQTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        uint32_t ak[4], av[4];
        ldmatrix_x4(ak, sK + (key_warp * 16 + lane % 16) * kRS + ks * 16 + (lane / 16) * 8);
        ldmatrix_x4(av, sV + (key_warp * 16 + lane % 16) * kRS + ks * 16 + (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < kBM / 16; ++np) {
          const int row = (np * 16 + (lane / 16) * 8 + lane % 8) * kRS + ks * 16 + ((lane / 8) % 2) * 8;
          uint32_t bq[4], bo[4];
          ldmatrix_x4(bq, cQ + row);
          ldmatrix_x4(bo, cdO + row);
          mma_16816<Element>(acc_s[2 * np], ak, bq[0], bq[1]);
          mma_16816<Element>(acc_s[2 * np + 1], ak, bq[2], bq[3]);
          mma_16816<Element>(acc_dp[2 * np], av, bo[0], bo[1]);
          mma_16816<Element>(acc_dp[2 * np + 1], av, bo[2], bo[3]);
        }
      }

      // P^T = exp2(cap(S^T * scale) * log2(e) + masks - lse); dS^T = P^T * (dP^T (+ gW^T) - delta),
      // times the soft-cap's derivative 1 - t^2 (t = tanh(S^T * scale / softcap)) when capped.
      const bool masked_tile = mask.reads_memory() || n0 + kBN > seqlen_k || m0 + kBM > seqlen_q ||
          (kIsCausal && n0 + kBN - 1 > m0 + shift) || (kIsCausal && bounds::window_hides(params, m0 + kBM - 1, n0, shift));
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key_a + (i / 2) * 8;
          const int qi = nt * 8 + col_in_tile + (i % 2);  // query within the block
          float s = acc_s[nt][i] * scale_log2;
          float cap_grad = 1.f;
          if (softcap.on) {
            const float t = softcap.tanh_of(acc_s[nt][i] * static_cast<float>(params.scale));
            s = softcap.cap * t * kLog2e;
            cap_grad = 1.f - t * t;
          }
          if (masked_tile) {
            s = mask.apply(s, m0 + qi, key);
            if (kIsCausal && bounds::window_hides(params, m0 + qi, key, shift)) {
              s = neg_inf<float>();
            }
          }
          if (alibi_on) {  // as the forward: -slope * |query + seqlen_k - seqlen_q - key|, after the masks
            s -= alibi_slope * static_cast<float>(iabs(m0 + qi + alibi_diagonal - key));
          }
          const float p = fast_exp2(s - cLse[qi]);
          float dp = acc_dp[nt][i];
          if (grad_weights != nullptr && m0 + qi < seqlen_q && key < seqlen_k) {
            dp += grad_weights[(m0 + qi) * params.grad_weights_row_stride + key];
          }
          acc_s[nt][i] = p;
          acc_dp[nt][i] = p * (dp - cDelta[qi]) * cap_grad;
        }
      }

      // dV += P^T dO and dK += dS^T Q: A from registers (two 8-query tiles = one 16-step),
      // B = dO / Q rows read transposed.
#pragma unroll
      for (int ks = 0; ks < kBM / 16; ++ks) {
        const uint32_t ap[4] = {
            pack2<Element>(acc_s[2 * ks][0], acc_s[2 * ks][1]),
            pack2<Element>(acc_s[2 * ks][2], acc_s[2 * ks][3]),
            pack2<Element>(acc_s[2 * ks + 1][0], acc_s[2 * ks + 1][1]),
            pack2<Element>(acc_s[2 * ks + 1][2], acc_s[2 * ks + 1][3]),
        };
        const uint32_t ads[4] = {
            pack2<Element>(acc_dp[2 * ks][0], acc_dp[2 * ks][1]),
            pack2<Element>(acc_dp[2 * ks][2], acc_dp[2 * ks][3]),
            pack2<Element>(acc_dp[2 * ks + 1][0], acc_dp[2 * ks + 1][1]),
            pack2<Element>(acc_dp[2 * ks + 1][2], acc_dp[2 * ks + 1][3]),
        };
#pragma unroll
        for (int dd = 0; dd < Traits::kColsPerWarp / 16; ++dd) {
          const int row = (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kRS + col0 + dd * 16 + (lane / 16) * 8;
          uint32_t bo[4], bq[4];
          ldmatrix_x4_trans(bo, cdO + row);
          ldmatrix_x4_trans(bq, cQ + row);
          mma_16816<Element>(acc_dv[2 * dd], ap, bo[0], bo[1]);
          mma_16816<Element>(acc_dv[2 * dd + 1], ap, bo[2], bo[3]);
          mma_16816<Element>(acc_dk[2 * dd], ads, bq[0], bq[1]);
          mma_16816<Element>(acc_dk[2 * dd + 1], ads, bq[2], bq[3]);
        }
      }

      // dS^T -> sdS, transposed to [query][key], by the first warp of each 16 keys.
      if (col0 == 0) {
#pragma unroll
        for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            sdS[(nt * 8 + col_in_tile + (i % 2)) * kDsRS + key_warp * 16 + lane / 4 + (i / 2) * 8] =
                from_acc<Element>(acc_dp[nt][i]);
          }
        }
      }
      __syncthreads();  // sdS is complete

      // dQ(block) += dS K: warp (wm, wn) computes queries wm*16.. x head dims wn*kDqCols..;
      // B = K rows read transposed.
      const int wm = warp % Traits::kDqWarpsM, wn = warp / Traits::kDqWarpsM;
      float acc_dq[kDqTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < kBN / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, sdS + (wm * 16 + lane % 16) * kDsRS + ks * 16 + (lane / 16) * 8);
#pragma unroll
        for (int dd = 0; dd < Traits::kDqCols / 16; ++dd) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kRS +
                                    wn * Traits::kDqCols + dd * 16 + (lane / 16) * 8);
          mma_16816<Element>(acc_dq[2 * dd], a, bk[0], bk[1]);
          mma_16816<Element>(acc_dq[2 * dd + 1], a, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + wm * 16 + lane / 4 + (i / 2) * 8;
        if (row < seqlen_q) {
          const int col = wn * Traits::kDqCols + col_in_tile + (i % 2);
          float* dq_row = dq_bh + static_cast<int64_t>(row) * dim + col;
#pragma unroll
          for (int dt = 0; dt < kDqTiles; ++dt) {
            if (col + dt * 8 < dim) {
              atomicAdd(dq_row + dt * 8, acc_dq[dt][i]);
            }
          }
        }
      }
      // The next iteration's first __syncthreads() orders these reads of sdS, sQ and sdO
      // before anything overwrites them.
    }
  }

  // dK = scale * sum dS^T Q (S was scale * Q K^T), dV = sum P^T dO.
  Element* dk = static_cast<Element*>(params.grad_k) + b * params.grad_k_batch_stride + h * params.grad_k_head_stride;
  Element* dv = static_cast<Element*>(params.grad_v) + b * params.grad_v_batch_stride + h * params.grad_v_head_stride;
  const float scale = static_cast<float>(params.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_a + r * 8;
    if (key < seqlen_k) {
      store_row(dk + key * params.grad_k_row_stride + col0 + col_in_tile, acc_dk, r, scale, col0, dim);
      store_row(dv + key * params.grad_v_row_stride + col0 + col_in_tile, acc_dv, r, 1.f, col0, dim_v);
    }
  }
#endif
}

// grad_q = scale * dq_accum, one element per thread (grid-stride).
template <typename Element>
__global__ void flash_bwd_dq_kernel(const AttentionBackwardParams params, const float* __restrict__ dq_accum) {
  const int64_t dim = params.head_dim, seqlen_q = params.seqlen_q;
  const int64_t total = params.batch * params.num_heads * seqlen_q * dim;
  const float scale = static_cast<float>(params.scale);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = idx % dim, row = (idx / dim) % seqlen_q, bh = idx / (dim * seqlen_q);
    const int64_t b = bh / params.num_heads, h = bh % params.num_heads;
    Element* dq = static_cast<Element*>(params.grad_q) + b * params.grad_q_batch_stride +
        h * params.grad_q_head_stride + row * params.grad_q_row_stride + d;
    *dq = from_acc<Element>(dq_accum[idx] * scale);
  }
}

}  // namespace device

// Host launcher, instantiated per (dtype, compiled head dim, causal) in flash_bwd_hdim*.cu, for
// any max(head_dim, head_dim_v) <= kHeadDim whose dims are multiples of 8. `dq_accum`
// ([batch, heads, seqlen_q, head_dim] float, the problem's own head_dim) must be zeroed and `delta` ([batch, heads,
// seqlen_q] float) computed, on `stream`, before this runs.
template <typename Element, int kHeadDim, bool kIsCausal, int kColSplit>
cudaError_t run_flash_bwd_(const AttentionBackwardParams& params, float* dq_accum, const float* delta,
                           cudaStream_t stream) {
  using Traits = FlashBwdTraits<kHeadDim, kColSplit>;
  static_assert(Traits::template smem_bytes<Element>() <= kSm80SmemOptin, "the tile must fit sm_80's shared memory");
  const dim3 grid(static_cast<unsigned>((params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN),
                  static_cast<unsigned>(params.num_heads), static_cast<unsigned>(params.batch));
  cudaError_t err = launch_kernel(device::flash_bwd_kernel<Traits, Element, kIsCausal>, grid,
                                  dim3(Traits::kNThreads), Traits::template smem_bytes<Element>(),
                                  stream, params, dq_accum, delta);
  if (err != cudaSuccess) {
    return err;
  }
  constexpr int kThreads = 256;
  const int64_t total = params.batch * params.num_heads * params.seqlen_q * params.head_dim;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid_dq = static_cast<unsigned>(blocks < 65536 ? blocks : 65536);  // grid-stride beyond
  return launch_kernel(device::flash_bwd_dq_kernel<Element>, dim3(grid_dq), dim3(kThreads), 0, stream,
                       params, static_cast<const float*>(dq_accum));
}

}  // namespace attn_export::cuda
