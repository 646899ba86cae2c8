// CPU kernels of the attention core: forward (with optional weights) and backward.
//
// Work is split into tasks of (batch, head, block of kQueryBlock query rows). A task computes
// its block's scores against the visible keys, applies masks and an exact row softmax, and
// multiplies by V, so memory is O(kQueryBlock x seqlen_k) per thread: the seqlen_q x seqlen_k
// matrix is never materialized unless the caller asks for the weights. The backward
// recomputes the probabilities from q, k and the saved log-sum-exp, one (batch, head) per
// task so that its dK/dV accumulation needs no synchronization.
//
// float16/bfloat16 inputs are converted to float32 first and every kernel runs in float32
// (float64 for float64 inputs), so half types accumulate in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "../../attention_params.h"
#include "../attention_binding.h"
#include "block_gemm.h"
#include "exp.h"

namespace attn_export::ops {
namespace {

using cpu::exp_approx;
using cpu::gemm_nn;
using cpu::gemm_nt;
using cpu::gemm_tn;

constexpr int64_t kQueryBlock = 64;
// Multiply-adds below which a parallel chunk is not worth waking another thread for.
constexpr int64_t kMinChunkWork = 1 << 15;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int64_t grain_for(int64_t task_work) {
  return std::max<int64_t>(1, kMinChunkWork / std::max<int64_t>(1, task_work));
}

// Query rows [0, row_end) see keys [0, visible) under top-left causal alignment.
int64_t visible_keys(const AttentionParams& p, int64_t row_end) {
  return p.is_causal ? std::min(p.seqlen_k, row_end) : p.seqlen_k;
}

template <typename T>
void apply_mask(const AttentionMask& m, int64_t offset, int64_t cols, T* scores) {
  if (m.kind == MaskKind::kBool) {
    const uint8_t* mask = static_cast<const uint8_t*>(m.ptr) + offset;
    for (int64_t j = 0; j < cols; ++j) {
      if (mask[j * m.col_stride]) {
        scores[j] = -std::numeric_limits<T>::infinity();
      }
    }
  } else {
    const T* mask = static_cast<const T*>(m.ptr) + offset;
    for (int64_t j = 0; j < cols; ++j) {
      scores[j] += mask[j * m.col_stride];
    }
  }
}

// s[r, j] = scale * q[row0 + r] . k[j] + masks, for r < rows and j < cols (row stride cols).
template <typename T>
void masked_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows,
                   int64_t cols, T* s) {
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
      row0 * p.q_row_stride;
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride;
  gemm_nt<T>(rows, cols, p.head_dim, static_cast<T>(p.scale), q, p.q_row_stride, k,
             p.k_row_stride, T(0), s, cols);
  const AttentionMask& am = p.attn_mask;
  const AttentionMask& kpm = p.key_padding_mask;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = row0 + r;
    T* row = s + r * cols;
    if (am.present()) {
      apply_mask(am, b * am.batch_stride + h * am.head_stride + i * am.row_stride, cols, row);
    }
    if (kpm.present()) {
      apply_mask(kpm, b * kpm.batch_stride, cols, row);
    }
    if (p.is_causal) {
      std::fill(row + std::min(cols, i + 1), row + cols, -std::numeric_limits<T>::infinity());
    }
  }
}

// In-place softmax of one row; returns its log-sum-exp. A row with no finite score (all keys
// masked) becomes zeros with lse = -inf instead of the 0/0 = NaN of a naive softmax.
template <typename T>
T softmax_row(T* x, int64_t n) {
  T max = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    max = std::max(max, x[j]);
  }
  if (max == -std::numeric_limits<T>::infinity()) {
    std::fill(x, x + n, T(0));
    return max;
  }
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = exp_approx(x[j] - max);
    sum += x[j];
  }
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    x[j] *= inv;
  }
  return max + std::log(sum);
}

// Recomputes probabilities from scores and the forward's log-sum-exp.
template <typename T>
void probabilities_from_lse(T* x, int64_t n, T lse) {
  if (lse == -std::numeric_limits<T>::infinity()) {
    std::fill(x, x + n, T(0));
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    x[j] = exp_approx(x[j] - lse);
  }
}

template <typename T>
void attention_forward_kernel(const AttentionParams& p) {
  const int64_t heads = p.num_heads, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int64_t block = std::max<int64_t>(1, std::min(seqlen_q, kQueryBlock));
  const int64_t blocks_per_head = ceil_div(seqlen_q, block);
  const int64_t tasks = p.batch * heads * blocks_per_head;
  const int64_t task_work = block * seqlen_k * (p.head_dim + p.head_dim_v);

  at::parallel_for(0, tasks, grain_for(task_work), [&](int64_t begin, int64_t end) {
    std::vector<T> scores(block * seqlen_k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / blocks_per_head, b = bh / heads, h = bh % heads;
      const int64_t row0 = (t % blocks_per_head) * block;
      const int64_t rows = std::min(block, seqlen_q - row0);
      const int64_t cols = visible_keys(p, row0 + rows);
      T* s = scores.data();

      masked_scores(p, b, h, row0, rows, cols, s);
      T* lse = static_cast<T*>(p.lse) + bh * seqlen_q + row0;
      for (int64_t r = 0; r < rows; ++r) {
        lse[r] = softmax_row(s + r * cols, cols);
      }

      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
      T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
          row0 * p.out_row_stride;
      gemm_nn<T>(rows, p.head_dim_v, cols, T(1), s, cols, v, p.v_row_stride, T(0), out,
                 p.out_row_stride);

      if (p.weights != nullptr) {
        T* w = static_cast<T*>(p.weights) + (bh * seqlen_q + row0) * seqlen_k;
        for (int64_t r = 0; r < rows; ++r) {
          std::copy(s + r * cols, s + (r + 1) * cols, w + r * seqlen_k);
          std::fill(w + r * seqlen_k + cols, w + (r + 1) * seqlen_k, T(0));
        }
      }
    }
  });
}

template <typename T>
void attention_backward_kernel(const AttentionBackwardParams& p) {
  const int64_t heads = p.num_heads, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v;
  const int64_t block = std::max<int64_t>(1, std::min(seqlen_q, kQueryBlock));
  const int64_t head_work = seqlen_q * seqlen_k * (2 * dim + 2 * dim_v);
  const T scale = static_cast<T>(p.scale);

  at::parallel_for(0, p.batch * heads, grain_for(head_work), [&](int64_t begin, int64_t end) {
    std::vector<T> probs(block * seqlen_k), grad_scores(block * seqlen_k);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
      const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + h * p.k_head_stride;
      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + h * p.v_head_stride;
      const T* grad_out = static_cast<const T*>(p.grad_out) + b * p.grad_out_batch_stride +
          h * p.grad_out_head_stride;
      T* grad_q = static_cast<T*>(p.grad_q) + b * p.grad_q_batch_stride + h * p.grad_q_head_stride;
      // This task owns the (b, h) slices of dK and dV: accumulate in place.
      T* grad_k = static_cast<T*>(p.grad_k) + b * p.grad_k_batch_stride + h * p.grad_k_head_stride;
      T* grad_v = static_cast<T*>(p.grad_v) + b * p.grad_v_batch_stride + h * p.grad_v_head_stride;
      cpu::scale_rows<T>(seqlen_k, dim, T(0), grad_k, p.grad_k_row_stride);
      cpu::scale_rows<T>(seqlen_k, dim_v, T(0), grad_v, p.grad_v_row_stride);

      for (int64_t row0 = 0; row0 < seqlen_q; row0 += block) {
        const int64_t rows = std::min(block, seqlen_q - row0);
        const int64_t cols = visible_keys(p, row0 + rows);
        T* P = probs.data();
        T* dS = grad_scores.data();
        const T* lse = static_cast<const T*>(p.lse) + bh * seqlen_q + row0;
        const T* dO = grad_out + row0 * p.grad_out_row_stride;

        masked_scores(p, b, h, row0, rows, cols, P);
        for (int64_t r = 0; r < rows; ++r) {
          probabilities_from_lse(P + r * cols, cols, lse[r]);
        }
        // dV += P^T dO
        gemm_tn<T>(cols, dim_v, rows, T(1), P, cols, dO, p.grad_out_row_stride, T(1), grad_v,
                   p.grad_v_row_stride);
        // dP = dO V^T (+ the gradient of the returned weights)
        gemm_nt<T>(rows, cols, dim_v, T(1), dO, p.grad_out_row_stride, v, p.v_row_stride, T(0),
                   dS, cols);
        if (p.grad_weights != nullptr) {
          for (int64_t r = 0; r < rows; ++r) {
            const T* gw = static_cast<const T*>(p.grad_weights) + b * p.grad_weights_batch_stride +
                h * p.grad_weights_head_stride + (row0 + r) * p.grad_weights_row_stride;
            T* row = dS + r * cols;
            for (int64_t j = 0; j < cols; ++j) {
              row[j] += gw[j];
            }
          }
        }
        // dS = P * (dP - rowsum(P * dP))
        for (int64_t r = 0; r < rows; ++r) {
          const T* prow = P + r * cols;
          T* row = dS + r * cols;
          T dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < cols; ++j) {
            dot += prow[j] * row[j];
          }
#pragma omp simd
          for (int64_t j = 0; j < cols; ++j) {
            row[j] = prow[j] * (row[j] - dot);
          }
        }
        // dQ = scale * dS K ; dK += scale * dS^T Q
        gemm_nn<T>(rows, dim, cols, scale, dS, cols, k, p.k_row_stride, T(0),
                   grad_q + row0 * p.grad_q_row_stride, p.grad_q_row_stride);
        gemm_tn<T>(cols, dim, rows, scale, dS, cols, q + row0 * p.q_row_stride, p.q_row_stride,
                   T(1), grad_k, p.grad_k_row_stride);
      }
    }
  });
}

// The kernels read the last dim contiguously and compute in the accumulation dtype.
at::Tensor kernel_operand(const at::Tensor& t, at::ScalarType dtype) {
  at::Tensor r = t.scalar_type() == dtype ? t : t.to(dtype);
  return r.size(-1) > 1 && r.stride(-1) != 1 ? r.contiguous() : r;
}

std::optional<at::Tensor> kernel_attn_mask(const std::optional<at::Tensor>& mask, int64_t batch,
                                           int64_t heads, at::ScalarType dtype) {
  if (!mask.has_value()) {
    return std::nullopt;
  }
  at::Tensor m = mask->scalar_type() == at::kBool ? *mask : mask->to(dtype);
  return broadcast_attn_mask(m, batch, heads);
}

std::optional<at::Tensor> kernel_padding_mask(const std::optional<at::Tensor>& mask,
                                              at::ScalarType dtype) {
  if (!mask.has_value()) {
    return std::nullopt;
  }
  return mask->scalar_type() == at::kBool ? *mask : mask->to(dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    bool need_weights) {
  check_attention_inputs(query, key, value, attn_mask, key_padding_mask);
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim_v = value.size(3);
  const auto options = query.options().dtype(acc);

  const at::Tensor q = kernel_operand(query, acc);
  const at::Tensor k = kernel_operand(key, acc);
  const at::Tensor v = kernel_operand(value, acc);
  at::Tensor out = empty_token_major(batch, heads, seqlen_q, dim_v, options);
  at::Tensor lse = at::empty({batch, heads, seqlen_q}, options);
  std::optional<at::Tensor> weights;
  if (need_weights) {
    weights = at::empty({batch, heads, seqlen_q, seqlen_k}, options);
  }
  const auto mask4d = kernel_attn_mask(attn_mask, batch, heads, acc);
  const auto padding = kernel_padding_mask(key_padding_mask, acc);

  const AttentionParams params = make_attention_params(
      q, k, v, out, lse, weights, mask4d, padding, resolve_scale(scale, query.size(3)), is_causal);
  if (acc == at::kDouble) {
    attention_forward_kernel<double>(params);
  } else {
    attention_forward_kernel<float>(params);
  }

  const at::ScalarType dtype = query.scalar_type();
  return std::make_tuple(
      out.to(dtype), lse,
      weights.has_value() ? weights->to(dtype) : at::empty({0}, query.options()));
}

at::Tensor attention_cpu(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale) {
  return std::get<0>(attention_forward_cpu(
      query, key, value, attn_mask, key_padding_mask, is_causal, scale, /*need_weights=*/false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_output,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale) {
  check_attention_inputs(query, key, value, attn_mask, key_padding_mask);
  check_attention_backward_inputs(grad_output, logsumexp, query, value);
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim_v = value.size(3);

  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const auto options = query.options().dtype(acc);
  const at::Tensor q = kernel_operand(query, acc);
  const at::Tensor k = kernel_operand(key, acc);
  const at::Tensor v = kernel_operand(value, acc);
  const at::Tensor grad_out = kernel_operand(grad_output, acc);
  const at::Tensor lse = logsumexp.to(acc).contiguous();
  at::Tensor grad_q = empty_token_major(batch, heads, seqlen_q, query.size(3), options);
  at::Tensor grad_k = empty_token_major(batch, heads, seqlen_k, key.size(3), options);
  at::Tensor grad_v = empty_token_major(batch, heads, seqlen_k, dim_v, options);
  const auto mask4d = kernel_attn_mask(attn_mask, batch, heads, acc);
  const auto padding = kernel_padding_mask(key_padding_mask, acc);

  std::optional<at::Tensor> gw;
  if (grad_weights.has_value() && grad_weights->defined()) {
    gw = kernel_operand(grad_weights->expand({batch, heads, seqlen_q, seqlen_k}), acc);
  }
  // The CPU backward recomputes each probability row in full, so it needs no forward output.
  AttentionParams forward = make_attention_params(
      q, k, v, grad_out, lse, std::nullopt, mask4d, padding, resolve_scale(scale, query.size(3)),
      is_causal);
  forward.out = nullptr;
  const AttentionBackwardParams params =
      make_attention_backward_params(forward, grad_out, gw, grad_q, grad_k, grad_v);

  if (acc == at::kDouble) {
    attention_backward_kernel<double>(params);
  } else {
    attention_backward_kernel<float>(params);
  }
  const at::ScalarType dtype = query.scalar_type();
  return std::make_tuple(grad_q.to(dtype), grad_k.to(dtype), grad_v.to(dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_export, CPU, m) {
  m.impl("attention", &attention_cpu);
  m.impl("_attention_forward", &attention_forward_cpu);
  m.impl("_attention_backward", &attention_backward_cpu);
}

}  // namespace attn_export::ops
