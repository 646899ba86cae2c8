// A vectorizable exp for the softmax loops. std::exp is an opaque libm call that stops the
// compiler from vectorizing a loop; this Cephes-style version (range reduction to
// [-ln2/2, ln2/2] and a degree-6 polynomial) is plain arithmetic, within 2 ulp of expf.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace attn_export::cpu {

inline float exp_approx(float x) {
  // Below -87 the result is under 1.7e-38: return exactly 0, which also maps the -inf of a
  // masked score to 0. NaN stays NaN (both clamps keep a NaN operand).
  const bool underflow = x < -87.0f;
  x = std::min(x, 88.0f);
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return underflow ? 0.0f : y * two_n;
}

// Double precision is the reference/gradcheck path: exactness matters more than speed there.
inline double exp_approx(double x) {
  return std::exp(x);
}

}  // namespace attn_export::cpu
