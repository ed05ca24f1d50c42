// Portable path of the quantized matmul (any CPU a C++ compiler targets) and the layout
// readers it shares with the tests; qgemm.h describes the layouts.
#include <cmath>
#include <cstring>

#include "qgemm.h"

namespace clover {

float from_f16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    float f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -f : f;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int level_at(const QGemm& a, int64_t n, int64_t k) {
  const int64_t G = a.K / a.group, t = n / 16, i = n % 16, g = k / a.group, kk = k % a.group;
  const uint8_t* base = a.q + (t * G + g) * tile_bytes(a.bits, a.group);
  const int e = kk % 2;
  if (a.bits != 8) {
    const int c = kk / 8, j = (kk % 8) / 2, w = 2 * i + e;
    uint16_t word;
    std::memcpy(&word, base + c * 64 + w * 2, 2);
    const int nibble = (word >> (4 * j)) & 15;
    if (a.bits == 4) return nibble;
    const auto bit = [&](int64_t at) {  // int5, int6: pair p = 4c + j's mask at `at`, bit w
      uint32_t high;
      std::memcpy(&high, base + at + 4 * (4 * c + j), 4);
      return static_cast<int>((high >> w) & 1u);
    };
    if (a.bits == 5) return nibble + 16 * bit(mask_offset(32, 0)) - 16;
    return nibble + 16 * bit(mask_offset(16, 0)) + 32 * bit(mask_offset(16, 1)) - 32;
  }
  return static_cast<int8_t>(base[(kk / 2) * 32 + 2 * i + e]);
}

float scale_at(const QGemm& a, int64_t n, int64_t g, bool low) {
  const int64_t G = a.K / a.group, t = n / 16, i = n % 16;
  const int64_t per = a.has_low ? 32 : 16;
  const int64_t at = (t * G + g) * per + (low ? 16 : 0) + i;
  if (a.f16_scales) return from_f16(static_cast<const uint16_t*>(a.scales)[at]);
  return static_cast<const float*>(a.scales)[at];
}

void qgemm_tiles_scalar(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t G = a.K / a.group;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m = 0; m < a.M; ++m) {
      const uint16_t* x = a.xb + m * a.K;
      for (int64_t n = 16 * t; n < 16 * t + 16; ++n) {
        float y = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k)
            dot += from_bf16(x[k]) * static_cast<float>(level_at(a, n, k));
          y += scale_at(a, n, g, false) * dot;
          if (a.has_low) y += scale_at(a, n, g, true) * a.xsum[m * G + g];
        }
        if (a.bias) y += a.bias[n];
        if (a.out_f32)
          a.out_f32[m * a.out_stride() + n] = y;
        else
          a.out_bf16[m * a.out_stride() + n] = to_bf16(y);
      }
    }
  }
}

}  // namespace clover
