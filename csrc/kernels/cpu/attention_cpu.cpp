// CPU kernels of the attention core: forward (with optional weights) and backward.
//
// Work is split into tasks of (batch, head, block of kQueryBlock query rows). A task computes
// its block's scores against the visible keys, applies masks and an exact row softmax, and
// multiplies by V, so memory is O(kQueryBlock x seqlen_k) per thread: the seqlen_q x seqlen_k
// matrix is never materialized unless the caller asks for the weights. The backward
// recomputes the probabilities from q, k and the saved log-sum-exp, one (batch, head) per
// task so that its dK/dV accumulation needs no synchronization.
//
// float16/bfloat16 inputs are converted to float32 by the binding (csrc/ops/cpu/
// attention_cpu_binding.cpp) and every kernel runs in float32 (float64 for float64 inputs), so
// half types accumulate in float32.
//
// Threads and BLAS come from the host through runtime.h (ATen's in the PyTorch extension), so
// that this file includes no framework header.
#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "alibi.h"
#include "block_gemm.h"
#include "flash_cpu.h"
#include "runtime.h"
#include "vec_kernels.h"

namespace attn_export::cpu {
namespace {

using rows::padded_cols;

// Query rows per task: as many as keep a block of scores near kBlockScores floats (1 MiB for
// float32, within L2), between kMinQueryBlock and kMaxQueryBlock. Larger blocks make the
// BLAS calls of long sequences more efficient; the bound keeps memory O(seqlen_k) per thread.
constexpr int64_t kBlockScores = 256 * 1024;
constexpr int64_t kMinQueryBlock = 16;
constexpr int64_t kMaxQueryBlock = 512;
// Multiply-adds below which a parallel chunk is not worth waking another thread for.
constexpr int64_t kMinChunkWork = 1 << 15;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t grain_for(int64_t task_work) {
  return std::max<int64_t>(1, kMinChunkWork / std::max<int64_t>(1, task_work));
}

int64_t query_block(const AttentionParams& p, bool split_heads_across_threads) {
  int64_t block = std::clamp(kBlockScores / std::max<int64_t>(1, p.seqlen_k), kMinQueryBlock, kMaxQueryBlock);
  const int64_t heads = p.batch * p.num_heads;
  const int64_t threads = num_threads();
  if (split_heads_across_threads && heads < 2 * threads) {
    // Few heads: smaller blocks, so that every thread gets work.
    block = std::min(block, std::max(kMinQueryBlock, ceil_div(p.seqlen_q * heads, 2 * threads)));
  }
  return std::max<int64_t>(1, std::min(block, p.seqlen_q));
}

// Row stride of a block of scores: whole vectors, plus one cache line when that is a
// multiple of 1 KiB: rows a power of two apart map to one or two L1 sets, and the products
// that walk 12 of them at once (linear_kernel.h) would evict their own operands.
int64_t score_stride(int64_t cols) {
  const int64_t padded = padded_cols(cols);
  return padded % 256 == 0 ? padded + cpu::rows::kRowAlign : padded;
}

// Query rows [0, row_end) see keys [0, visible): all of them, or up to the causal diagonal of
// the last row (row_end >= 1).
int64_t visible_keys(const AttentionParams& p, int64_t row_end) {
  return p.is_causal ? p.causal_key_end(row_end - 1) : p.seqlen_k;
}

template <typename T>
void apply_mask(const AttentionMask& m, int64_t offset, int64_t cols, T* scores) {
  if (m.kind == MaskKind::kBool) {
    vec::apply_bool_mask_row(static_cast<const uint8_t*>(m.ptr) + offset, m.col_stride, scores, cols);
  } else {
    vec::add_mask_row(static_cast<const T*>(m.ptr) + offset, m.col_stride, scores, cols);
  }
}

// x[r, j] = scale * q[row0 + r] . k[j], for r < rows and j < cols, rows ld apart.
//
// keys_t, when given, is scale * K^T of this (batch, head) as HeadTransposed::keys gives it.
template <typename T>
void scaled_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows,
                   int64_t cols, T* s, int64_t ld, const float* keys_t) {
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
      row0 * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + p.kv_head(h) * p.k_head_stride;
  scores_nt<T>(rows, cols, p.head_dim, static_cast<T>(p.scale), q, p.q_row_stride, k, p.k_row_stride, s, ld,
               keys_t, p.seqlen_k);
}

// Logit soft-capping of a block of scaled scores: s = softcap * tanh(x / softcap) (s may be x).
// Called only when p.softcap > 0, so the uncapped path costs one branch per block.
template <typename T>
void soft_cap(const AttentionParams& p, int64_t rows, int64_t cols, const T* x, T* s, int64_t ld) {
  const T cap = static_cast<T>(p.softcap), inv_cap = T(1) / cap;
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * ld;
    T* out = s + r * ld;
    for (int64_t j = 0; j < cols; ++j) {
      out[j] = cap * std::tanh(in[j] * inv_cap);
    }
  }
}

// The masks (and ALiBi's bias, with slopes) of query rows [row0, row0 + rows) added to a block of
// scores (rows ld >= padded_cols(cols) apart); [cols, padded_cols(cols)) is set to -inf, so that it
// vanishes in the softmax.
template <typename T>
void add_masks(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t cols, T* s,
               int64_t ld) {
  const AttentionMask& am = p.attn_mask;
  const AttentionMask& kpm = p.key_padding_mask;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = row0 + r;
    T* row = s + r * ld;
    std::fill(row + cols, row + padded_cols(cols), -std::numeric_limits<T>::infinity());
    add_alibi(p, h, i, 0, cols, row);  // finite: a -inf mask below still removes the key
    if (am.present()) {
      apply_mask(am, b * am.batch_stride + h * am.head_stride + i * am.row_stride, cols, row);
    }
    if (kpm.present()) {
      apply_mask(kpm, b * kpm.batch_stride, cols, row);
    }
    if (p.is_causal) {
      std::fill(row + std::min(cols, p.causal_key_end(i)), row + cols, -std::numeric_limits<T>::infinity());
      // The sliding window's keys before causal_key_begin(i) (none without a window).
      std::fill(row, row + std::min(cols, p.causal_key_begin(i)), -std::numeric_limits<T>::infinity());
    }
  }
}

// s[r, j] = cap(scale * q[row0 + r] . k[j]) + masks (+ ALiBi), for r < rows and j < cols (cap:
// the soft-cap when p.softcap > 0, else the identity), padded as add_masks does.
template <typename T>
void masked_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows,
                   int64_t cols, T* s, int64_t ld, const float* keys_t = nullptr) {
  scaled_scores(p, b, h, row0, rows, cols, s, ld, keys_t);
  if (p.softcap > 0) {  // before the masks: a -inf mask still removes the key
    soft_cap(p, rows, cols, s, s, ld);
  }
  add_masks(p, b, h, row0, rows, cols, s, ld);
}

// alpha * X^T of one (batch, head) of K or V, row-major [dim, seqlen_k]: the B of a
// scores-like product A X^T in the layout of block_gemm.h's tiled kernel (float32, AVX-512).
// A head's query blocks come one after another (consecutive forward tasks, the backward's
// inner loop), so each head is transposed once instead of once per block.
class HeadTransposed {
 public:
  // nullptr where the product stays with scores_nt (other dtypes, small blocks).
  template <typename T>
  const float* get(const void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                   int64_t dim, float alpha, const AttentionParams& p, int64_t b, int64_t h,
                   int64_t rows, int64_t cols) {
    if constexpr (!std::is_same_v<T, float>) {
      return nullptr;
    } else {
      if (!product_uses_linear_kernel<float>(rows, cols, dim)) {
        return nullptr;
      }
      const int64_t kv = p.kv_head(h), bh = b * p.num_heads + kv;  // a group's query heads share it
      if (bh != head_) {
        data_.resize(static_cast<size_t>(dim * p.seqlen_k));
        const float* x = static_cast<const float*>(base) + b * batch_stride + kv * head_stride;
        transpose_scaled(p.seqlen_k, dim, alpha, x, row_stride, data_.data());
        head_ = bh;
      }
      return data_.data();
    }
  }

  template <typename T>
  const float* keys(const AttentionParams& p, int64_t b, int64_t h, int64_t rows, int64_t cols) {
    return get<T>(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.head_dim,
                  static_cast<float>(p.scale), p, b, h, rows, cols);
  }

 private:
  std::vector<float> data_;
  int64_t head_ = -1;
};

template <typename T>
void attention_forward_kernel(const AttentionParams& p) {
  const int64_t heads = p.num_heads, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int64_t block = query_block(p, /*split_heads_across_threads=*/true);
  const int64_t blocks_per_head = ceil_div(seqlen_q, block);
  const int64_t tasks = p.batch * heads * blocks_per_head;
  const int64_t task_work = block * seqlen_k * (p.head_dim + p.head_dim_v);

  parallel_for(0, tasks, grain_for(task_work), [&](int64_t begin, int64_t end) {
    std::vector<T> scores(p.weights != nullptr && seqlen_k % cpu::rows::kRowAlign == 0
                              ? 0
                              : block * score_stride(seqlen_k));
    std::vector<T> row_scale(block);
    HeadTransposed keys_t;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / blocks_per_head, b = bh / heads, h = bh % heads;
      const int64_t row0 = (t % blocks_per_head) * block;
      const int64_t rows = std::min(block, seqlen_q - row0);
      const int64_t cols = visible_keys(p, row0 + rows);
      // With weights requested and whole-vector rows, the probabilities are computed in place
      // in the weights tensor: no copy of the Lq x Lk matrix.
      T* weights = p.weights == nullptr
          ? nullptr
          : static_cast<T*>(p.weights) + (bh * seqlen_q + row0) * seqlen_k;
      const bool in_place = weights != nullptr && seqlen_k % cpu::rows::kRowAlign == 0;
      const int64_t ld = in_place ? seqlen_k : score_stride(cols);
      T* s = in_place ? weights : scores.data();

      masked_scores(p, b, h, row0, rows, cols, s, ld, keys_t.keys<T>(p, b, h, rows, cols));
      T* lse = static_cast<T*>(p.lse) + bh * seqlen_q + row0;
      // Without weights to return, P stays unnormalized and the output rows are scaled.
      T* scale = weights == nullptr ? row_scale.data() : nullptr;
      vec::softmax_rows(s, rows, cols, ld, lse, scale);

      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + p.kv_head(h) * p.v_head_stride;
      T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
          row0 * p.out_row_stride;
      gemm_nn<T>(rows, p.head_dim_v, cols, T(1), s, ld, v, p.v_row_stride, T(0), out,
                 p.out_row_stride);
      if (scale != nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
          T* row = out + r * p.out_row_stride;
          for (int64_t d = 0; d < p.head_dim_v; ++d) {
            row[d] *= scale[r];
          }
        }
      }

      if (weights != nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
          T* w = weights + r * seqlen_k;
          if (!in_place) {
            std::copy(s + r * ld, s + r * ld + cols, w);
          }
          // From cols, not padded_cols(cols): the softmax may leave the padding's -inf in
          // place (the float64 path writes only the visible columns).
          std::fill(w + cols, w + seqlen_k, T(0));
        }
      }
    }
  });
}

// dS (the gradient of the capped scores, rows ld apart) becomes the gradient of the scaled
// scores x (`raw`, as scaled_scores gives them): dS * (1 - t^2), t = tanh(x / softcap). Masked
// keys have P = 0, hence dS = 0, and x is finite there (no mask is added to it): no -inf * 0.
template <typename T>
void soft_cap_backward(const AttentionParams& p, int64_t rows, int64_t cols, const T* raw, T* dS, int64_t ld) {
  const T inv_cap = T(1) / static_cast<T>(p.softcap);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = raw + r * ld;
    T* ds = dS + r * ld;
    for (int64_t j = 0; j < cols; ++j) {
      const T t = std::tanh(x[j] * inv_cap);
      ds[j] *= T(1) - t * t;
    }
  }
}

// The backward's products into dQ, dK and dV for one (batch, head) at a time. dK and dV
// accumulate over the head's query blocks: dV += P^T dO, dK += scale dS^T Q. BLAS takes
// those transposed operands as they are; the tiled kernel (float32, AVX-512, large blocks)
// needs its B read along keys, so it accumulates dK^T += Q^T (scale dS) and dV^T += dO^T P
// into [dim, Lk] buffers and transposes them into dK and dV once, when the head is done.
template <typename T>
class KeyValueGrads {
 public:
  KeyValueGrads(const AttentionBackwardParams& p, int64_t block)
      : p_(p), tiled_(product_uses_linear_kernel<T>(block, p.seqlen_k, std::min(p.head_dim, p.head_dim_v))) {}

  void begin_head(T* grad_k, T* grad_v) {
    grad_k_ = grad_k;
    grad_v_ = grad_v;
    if (tiled_) {
      ld_ = score_stride(p_.seqlen_k);
      grad_k_t_.assign(static_cast<size_t>(p_.head_dim * ld_), 0.0f);
      grad_v_t_.assign(static_cast<size_t>(p_.head_dim_v * ld_), 0.0f);
    } else {
      vec::scale_rows(p_.seqlen_k, p_.head_dim, T(0), grad_k, p_.grad_k_row_stride);
      vec::scale_rows(p_.seqlen_k, p_.head_dim_v, T(0), grad_v, p_.grad_v_row_stride);
    }
  }

  // dV += P^T dO over keys [0, cols) for `rows` query rows.
  void add_grad_v(const T* P, int64_t ld, const T* dO, int64_t rows, int64_t cols) {
    if constexpr (std::is_same_v<T, float>) {
      if (tiled_) {
        transposed(dO, p_.grad_out_row_stride, rows, p_.head_dim_v);
        linear_block(p_.head_dim_v, cols, rows, a_t_.data(), rows, P, ld, grad_v_t_.data(), ld_, true);
        return;
      }
    }
    gemm_tn<T>(cols, p_.head_dim_v, rows, T(1), P, ld, dO, p_.grad_out_row_stride, T(1), grad_v_,
               p_.grad_v_row_stride);
  }

  // dQ = scale dS K (rows x dim, into grad_q) and dK += scale dS^T Q. May scale dS in place.
  void add_grad_q_k(T* dS, int64_t ld, const T* k, const T* q, T* grad_q, int64_t rows, int64_t cols) {
    const T scale = static_cast<T>(p_.scale);
    if constexpr (std::is_same_v<T, float>) {
      if (tiled_) {
        for (int64_t r = 0; r < rows; ++r) {
          vec::scale_rows(1, cols, scale, dS + r * ld, ld);
        }
        linear_block(rows, p_.head_dim, cols, dS, ld, k, p_.k_row_stride, grad_q, p_.grad_q_row_stride);
        transposed(q, p_.q_row_stride, rows, p_.head_dim);
        linear_block(p_.head_dim, cols, rows, a_t_.data(), rows, dS, ld, grad_k_t_.data(), ld_, true);
        return;
      }
    }
    gemm_nn<T>(rows, p_.head_dim, cols, scale, dS, ld, k, p_.k_row_stride, T(0), grad_q, p_.grad_q_row_stride);
    gemm_tn<T>(cols, p_.head_dim, rows, scale, dS, ld, q, p_.q_row_stride, T(1), grad_k_, p_.grad_k_row_stride);
  }

  void end_head() {
    if constexpr (std::is_same_v<T, float>) {
      if (tiled_) {
        // [dim, Lk] -> [Lk, dim]: transpose_scaled reads rows of its source, here the columns.
        transpose_scaled(p_.head_dim, p_.seqlen_k, 1.0f, grad_k_t_.data(), ld_, a_t_for(p_.seqlen_k, p_.head_dim));
        copy_rows(a_t_.data(), p_.head_dim, grad_k_, p_.grad_k_row_stride, p_.head_dim);
        transpose_scaled(p_.head_dim_v, p_.seqlen_k, 1.0f, grad_v_t_.data(), ld_, a_t_for(p_.seqlen_k, p_.head_dim_v));
        copy_rows(a_t_.data(), p_.head_dim_v, grad_v_, p_.grad_v_row_stride, p_.head_dim_v);
      }
    }
  }

 private:
  float* a_t_for(int64_t rows, int64_t cols) {
    a_t_.resize(static_cast<size_t>(rows * cols));
    return a_t_.data();
  }

  // a_t_ = x^T for x: [rows, dim] rows `stride` apart.
  void transposed(const T* x, int64_t stride, int64_t rows, int64_t dim) {
    if constexpr (std::is_same_v<T, float>) {
      transpose_scaled(rows, dim, 1.0f, x, stride, a_t_for(dim, rows));
    }
  }

  void copy_rows(const float* src, int64_t width, T* dst, int64_t dst_stride, int64_t cols) {
    for (int64_t j = 0; j < p_.seqlen_k; ++j) {
      std::copy(src + j * width, src + j * width + cols, dst + j * dst_stride);
    }
  }

  const AttentionBackwardParams& p_;
  const bool tiled_;
  T* grad_k_ = nullptr;
  T* grad_v_ = nullptr;
  int64_t ld_ = 0;
  std::vector<float> grad_k_t_, grad_v_t_, a_t_;
};

template <typename T>
void attention_backward_kernel(const AttentionBackwardParams& p) {
  const int64_t heads = p.num_heads, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v;
  const int64_t block = query_block(p, /*split_heads_across_threads=*/false);
  const int64_t head_work = seqlen_q * seqlen_k * (2 * dim + 2 * dim_v);

  parallel_for(0, p.batch * heads, grain_for(head_work), [&](int64_t begin, int64_t end) {
    std::vector<T> probs(block * score_stride(seqlen_k)), grad_scores(block * score_stride(seqlen_k));
    // The block's uncapped scaled scores, for the soft-cap's derivative (only with softcap).
    std::vector<T> raw_scores(p.softcap > 0 ? block * score_stride(seqlen_k) : 0);
    HeadTransposed keys_t, values_t;
    KeyValueGrads<T> grads(p, block);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + p.kv_head(h) * p.k_head_stride;
      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + p.kv_head(h) * p.v_head_stride;
      const T* grad_out = static_cast<const T*>(p.grad_out) + b * p.grad_out_batch_stride +
          h * p.grad_out_head_stride;
      T* grad_q = static_cast<T*>(p.grad_q) + b * p.grad_q_batch_stride + h * p.grad_q_head_stride;
      // This task owns the (b, h) slices of dK and dV (per query head: attention_params.h):
      // accumulate in place.
      grads.begin_head(static_cast<T*>(p.grad_k) + b * p.grad_k_batch_stride + h * p.grad_k_head_stride,
                       static_cast<T*>(p.grad_v) + b * p.grad_v_batch_stride + h * p.grad_v_head_stride);

      for (int64_t row0 = 0; row0 < seqlen_q; row0 += block) {
        const int64_t rows = std::min(block, seqlen_q - row0);
        const int64_t cols = visible_keys(p, row0 + rows);
        const int64_t ld = score_stride(cols);
        T* P = probs.data();
        T* dS = grad_scores.data();
        const T* lse = static_cast<const T*>(p.lse) + bh * seqlen_q + row0;
        const T* dO = grad_out + row0 * p.grad_out_row_stride;
        // With a soft-cap, the cap's derivative needs the uncapped scaled scores x, which the
        // masked scores do not give back: x is computed once, and P from it.
        T* raw = p.softcap > 0 ? raw_scores.data() : nullptr;
        if (raw != nullptr) {
          scaled_scores(p, b, h, row0, rows, cols, raw, ld, keys_t.keys<T>(p, b, h, rows, cols));
        }

        if (raw != nullptr) {
          soft_cap(p, rows, cols, raw, P, ld);
          add_masks(p, b, h, row0, rows, cols, P, ld);
        } else {
          masked_scores(p, b, h, row0, rows, cols, P, ld, keys_t.keys<T>(p, b, h, rows, cols));
        }
        for (int64_t r = 0; r < rows; ++r) {
          vec::probabilities_row(P + r * ld, cols, lse[r]);
        }
        grads.add_grad_v(P, ld, dO, rows, cols);
        // dP = dO V^T (+ the gradient of the returned weights); padding 0 like P's
        const float* v_t = values_t.get<T>(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, dim_v,
                                           1.0f, p, b, h, rows, cols);
        scores_nt<T>(rows, cols, dim_v, T(1), dO, p.grad_out_row_stride, v, p.v_row_stride, dS, ld, v_t, seqlen_k);
        for (int64_t r = 0; r < rows; ++r) {
          T* row = dS + r * ld;
          std::fill(row + cols, row + ld, T(0));
          if (p.grad_weights != nullptr) {
            const T* gw = static_cast<const T*>(p.grad_weights) + b * p.grad_weights_batch_stride +
                h * p.grad_weights_head_stride + (row0 + r) * p.grad_weights_row_stride;
            for (int64_t j = 0; j < cols; ++j) {
              row[j] += gw[j];
            }
          }
          // dS = P * (dP - rowsum(P * dP))
          vec::softmax_backward_row(P + r * ld, row, cols);
        }
        if (raw != nullptr) {
          soft_cap_backward(p, rows, cols, raw, dS, ld);
        }
        grads.add_grad_q_k(dS, ld, k, q + row0 * p.q_row_stride, grad_q + row0 * p.grad_q_row_stride, rows, cols);
      }
      grads.end_head();
    }
  });
}

// Calls run(T{}) with T the kernels' element type for p.dtype; false for dtypes they do not take.
template <typename Params, typename Run>
bool by_dtype(const Params& p, Run run) {
  if (p.dtype == DataType::kFloat64) {
    run(double{});
  } else if (p.dtype == DataType::kFloat32) {
    run(float{});
  } else {
    return false;
  }
  return true;
}

}  // namespace

bool run_attention_forward(const AttentionParams& p) {
  if (flash::forward(p)) {
    return true;
  }
  return by_dtype(p, [&](auto zero) { attention_forward_kernel<decltype(zero)>(p); });
}

bool run_attention_backward(const AttentionBackwardParams& p) {
  if (flash::backward(p)) {
    return true;
  }
  return by_dtype(p, [&](auto zero) { attention_backward_kernel<decltype(zero)>(p); });
}

}  // namespace attn_export::cpu
