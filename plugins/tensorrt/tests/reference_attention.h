// The attention the FusedAttention node defines (docs/onnx_node.md), in float64, straight from
// token-major [B, L, H*D] arrays (key/value [B, Lk, Hkv*D]: query head h reads head
// h / (H / Hkv)) and masks expanded to [B, Lk] and [B, H, Lq, Lk]; causal masking top-left
// (alignment 0) or bottom-right (1: key j visible to query i when j <= i + Lk - Lq); ALiBi slopes
// (one per query head, empty = none) add -slope[h] * |i + Lk - Lq - j| whatever the alignment: the
// reference of core_test.cpp (AttentionParams) and host_check.cpp (the plugin on a GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attn_export::trt_plugin::testing {

inline std::vector<double> reference_attention(int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv,
                                               double scale, bool causal, const std::vector<float>& q,
                                               const std::vector<float>& k, const std::vector<float>& v,
                                               const std::vector<float>& kpm, const std::vector<float>& mask,
                                               double softcap = 0.0, int64_t Hkv = 0, int alignment = 0,
                                               const std::vector<float>& alibi_slopes = {}) {
  if (Hkv == 0) Hkv = H;
  const int64_t shift = alignment == 1 ? Lk - Lq : 0;
  std::vector<double> out(B * Lq * H * Dv, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t g = h / (H / Hkv);
        std::vector<double> s(Lk);
        double top = -INFINITY;
        for (int64_t j = 0; j < Lk; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += double(q[(b * Lq + i) * H * D + h * D + d]) * k[(b * Lk + j) * Hkv * D + g * D + d];
          const double x = scale * dot;
          s[j] = (softcap > 0 ? softcap * std::tanh(x / softcap) : x) + kpm[b * Lk + j] +
              mask[((b * H + h) * Lq + i) * Lk + j];
          if (!alibi_slopes.empty()) s[j] -= double(alibi_slopes[h]) * std::abs(double(i + Lk - Lq - j));
          if (causal && j > i + shift) s[j] = -INFINITY;
          top = std::max(top, s[j]);
        }
        if (top == -INFINITY) continue;  // a query that sees no key: zeros, never NaN
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - top));
        for (int64_t j = 0; j < Lk; ++j)
          for (int64_t d = 0; d < Dv; ++d)
            out[(b * Lq + i) * H * Dv + h * Dv + d] += s[j] / sum * v[(b * Lk + j) * Hkv * Dv + g * Dv + d];
      }
  return out;
}

}  // namespace attn_export::trt_plugin::testing
