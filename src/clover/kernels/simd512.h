// AVX-512 helpers shared by the bfloat16 (qgemm_avx512.cpp) and integer-dot (qgemm_vnni.cpp)
// kernels. Include it after the file's `#pragma GCC target` (or clang attribute), inside the
// region that enables AVX-512: each file compiles its own copy for its own instruction set.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qgemm.h"

#define CLOVER_INLINE inline __attribute__((always_inline))

namespace clover {
namespace {

// 16 scales (or lows) of a tile's group as float32, stored in float16 or float32
template <bool F16>
CLOVER_INLINE __m512 load16(const void* p, int64_t at) {
  if (F16)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(p) + at);
}

// Tile t's 16 scales (s) and lows (l) of group g (G a row): stored (float16 or float32), or
// compact (`QGemm::mults`): float32(mult) * base, the stored float32 value to the bit
template <bool F16, bool LOW>
CLOVER_INLINE void scales16(const QGemm& a, int64_t t, int64_t G, int64_t g, __m512& s,
                            __m512& l) {
  constexpr int64_t per = LOW ? 32 : 16;
  const int64_t at = (t * G + g) * per;
  if (a.mults != nullptr) {
    const int64_t bt = ((t * G >> a.base_shift) + (g >> a.base_shift)) * per;
    const auto mult = [&](int64_t i) {
      const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.mults + i));
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m));
    };
    s = _mm512_mul_ps(mult(at), _mm512_loadu_ps(a.bases + bt));
    l = LOW ? _mm512_mul_ps(mult(at + 16), _mm512_loadu_ps(a.bases + bt + 16)) : _mm512_setzero_ps();
    return;
  }
  s = load16<F16>(a.scales, at);
  l = LOW ? load16<F16>(a.scales, at + 16) : _mm512_setzero_ps();
}

// the 4 bytes at p (a pair of bfloat16 x, or 4 int8 x) in every 32-bit lane
CLOVER_INLINE __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

}  // namespace
}  // namespace clover
