// AVX-512 helpers shared by the bfloat16 (qgemm_avx512.cpp) and integer-dot (qgemm_vnni.cpp)
// kernels. Include it after the file's `#pragma GCC target` (or clang attribute), inside the
// region that enables AVX-512: each file compiles its own copy for its own instruction set.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

// the 4 bytes at p (a pair of bfloat16 x, or 4 int8 x) in every 32-bit lane
CLOVER_INLINE __m512i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

}  // namespace
}  // namespace clover
