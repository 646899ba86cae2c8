// A vectorizable exp for the softmax loops. std::exp is an opaque libm call that stops the
// compiler from vectorizing a loop; this one is plain arithmetic: n = round(x / ln 2), r = x - n
// ln 2 in [-ln2/2, ln2/2] (Cody-Waite: ln 2 in two parts, so that n ln2_hi is exact), then
// exp(r) by a degree-6 polynomial and the product with 2^n built from its exponent bits.
// The polynomial is a relative-error minimax fit (Lawson-weighted least squares on Chebyshev
// nodes, float64), 3.1e-9 from exp on the interval, below float's rounding; evaluated in float
// the whole is within 1.2 ulp of exp(x) over [-87, 0] (tests/ops/cpu/test_flash_cpu.py holds the
// softmax built on it to float64). Cephes' expf, used before, spends a degree-7 polynomial.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace attn_export::cpu {

constexpr float kLn2Hi = 0.693359375f;      // ln 2 rounded to 9 bits: n * kLn2Hi is exact
constexpr float kLn2Lo = -2.12194440e-4f;   // ln 2 - kLn2Hi
constexpr int kExpPolyTerms = 7;
// exp(r) ~ sum c_i r^i, highest degree first (Horner's order); c1 = c0 = 1.
constexpr float kExpPoly[kExpPolyTerms] = {1.381461276e-03f, 8.368710056e-03f, 4.166838899e-02f,
                                           1.666652113e-01f, 4.999999404e-01f, 1.0f, 1.0f};
// The bits of 1.5 * 2^23: t = y + 1.5 * 2^23 rounds y to an integer n held in t's low mantissa
// bits, bits(t) = kRoundBits + n for |n| < 2^22.
constexpr int32_t kRoundBits = 0x4B400000;

inline float exp_approx(float x) {
  // Below -87 the result is under 1.7e-38: return exactly 0, which also maps the -inf of a
  // masked score to 0. NaN stays NaN (both clamps keep a NaN operand).
  const bool underflow = x < -87.0f;
  x = std::min(x, 88.0f);
  x = std::max(x, -87.0f);
  // Rounded as the vector version rounds (to nearest even), so that a row's tail agrees with
  // its vector body.
  const float t = x * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  const float r = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < kExpPolyTerms; ++i) {
    p = p * r + kExpPoly[i];
  }
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return underflow ? 0.0f : p * two_n;
}

// Double precision is the reference/gradcheck path: exactness matters more than speed there.
inline double exp_approx(double x) {
  return std::exp(x);
}

}  // namespace attn_export::cpu
