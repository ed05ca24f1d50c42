// AVX2 + FMA path of the quantized matmul, for x86 CPUs without AVX-512 BF16. No bfloat16
// dot instruction here: levels are widened to float32 and multiplied with FMA. Lanes hold
// (row, k parity) pairs, so the packed layout of qgemm.h is read as it is; the two parities
// of a row are added once at the end.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qgemm.h"

#define CLOVER_INLINE inline __attribute__((always_inline))

namespace clover {
namespace {

// pair p of a tile -> w[h]: rows 4h..4h+3 x (k even, k odd) as float32
template <int BITS>
CLOVER_INLINE void unpack_pair(const uint8_t* base, int p, __m256* w) {
  uint32_t high = 0;  // int5: bit w = the high bit of word w's level (qgemm.h)
  if (BITS == 5) std::memcpy(&high, base + 256 + 4 * p, 4);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int h = 0; h < 4; ++h) {
    __m256i d;
    if (BITS != 8) {
      const uint8_t* words = base + 64 * (p / 4) + 16 * h;
      d = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words)));
      d = _mm256_srl_epi32(d, _mm_cvtsi32_si128(4 * (p % 4)));
      d = _mm256_and_si256(d, _mm256_set1_epi32(15));
      if (BITS == 5) {  // + 16 where the high bit is set, then -16: levels -16..15
        const __m256i m = _mm256_set1_epi32(static_cast<int>((high >> (8 * h)) & 0xff));
        const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(m, bit), bit);
        d = _mm256_add_epi32(d, _mm256_and_si256(set, _mm256_set1_epi32(16)));
        d = _mm256_sub_epi32(d, _mm256_set1_epi32(16));
      }
    } else {
      d = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + 32 * p + 8 * h)));
    }
    w[h] = _mm256_cvtepi32_ps(d);
  }
}

// x[k], x[k + 1] (bfloat16) -> [x0, x1] x 4 as float32
CLOVER_INLINE __m256 pair(const uint16_t* x) {
  const uint64_t f = (static_cast<uint64_t>(x[0]) << 16) | (static_cast<uint64_t>(x[1]) << 48);
  return _mm256_castsi256_ps(_mm256_set1_epi64x(static_cast<long long>(f)));
}

// 16 scales -> 4 vectors, each rows 4h..4h+3 with every value twice (once per parity)
template <bool F16>
CLOVER_INLINE void load_dup(const void* p, int64_t at, bool even_only, __m256* out) {
  __m256 half[2];
  for (int i = 0; i < 2; ++i) {
    if (F16)
      half[i] = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at + 8 * i)));
    else
      half[i] = _mm256_loadu_ps(static_cast<const float*>(p) + at + 8 * i);
  }
  const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  for (int h = 0; h < 4; ++h) {
    out[h] = _mm256_permutevar8x32_ps(half[h / 2], h % 2 ? hi : lo);
    if (even_only) out[h] = _mm256_blend_ps(out[h], _mm256_setzero_ps(), 0xaa);
  }
}

constexpr int64_t kRowChunk = 64;

template <int P, int BITS, bool LOW, bool F16>
void run(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / a.group, per = LOW ? 32 : 16;
  const int64_t tile = BITS == 4 ? 256 : BITS == 5 ? 320 : 32 * P;
  alignas(32) float y[kRowChunk * 32];  // (row, parity) lanes
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, a.M - m0);
      std::memset(y, 0, sizeof(float) * 32 * mc);
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* base = a.q + (t * G + g) * tile;
        const int64_t at = (t * G + g) * per;
        __m256 s[4], l[4];
        load_dup<F16>(a.scales, at, false, s);
        if (LOW) load_dup<F16>(a.scales, at + 16, true, l);
        for (int64_t r0 = 0; r0 < mc; r0 += 2) {
          const int mb = mc - r0 >= 2 ? 2 : 1;
          const uint16_t* x = a.xb + (m0 + r0) * K + g * a.group;
          __m256 acc[2][4], w[4];
          for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 4; ++h) acc[r][h] = _mm256_setzero_ps();
          for (int p = 0; p < P; ++p) {
            unpack_pair<BITS>(base, p, w);
            for (int r = 0; r < mb; ++r) {
              const __m256 bx = pair(x + r * K + 2 * p);
              for (int h = 0; h < 4; ++h) acc[r][h] = _mm256_fmadd_ps(w[h], bx, acc[r][h]);
            }
          }
          for (int r = 0; r < mb; ++r) {
            float* yr = y + 32 * (r0 + r);
            const __m256 xs = LOW ? _mm256_set1_ps(a.xsum[(m0 + r0 + r) * G + g]) : __m256{};
            for (int h = 0; h < 4; ++h) {
              __m256 v = _mm256_fmadd_ps(acc[r][h], s[h], _mm256_loadu_ps(yr + 8 * h));
              if (LOW) v = _mm256_fmadd_ps(xs, l[h], v);
              _mm256_storeu_ps(yr + 8 * h, v);
            }
          }
        }
      }
      for (int64_t r = 0; r < mc; ++r) {
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t n = 16 * t + i;
          float v = y[32 * r + 2 * i] + y[32 * r + 2 * i + 1];
          if (a.bias) v += a.bias[n];
          if (a.out_f32)
            a.out_f32[(m0 + r) * a.N + n] = v;
          else
            a.out_bf16[(m0 + r) * a.N + n] = to_bf16(v);
        }
      }
    }
  }
}

}  // namespace

void qgemm_tiles_avx2(const QGemm& a, int64_t t0, int64_t t1) {
  dispatch_format(a, [&](auto P, auto BITS, auto LOW, auto F16) {
    run<decltype(P)::value, decltype(BITS)::value, decltype(LOW)::value, decltype(F16)::value>(
        a, t0, t1);
  });
}

}  // namespace clover

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
#include "qgemm.h"
namespace clover {
void qgemm_tiles_avx2(const QGemm& a, int64_t t0, int64_t t1) { qgemm_tiles_scalar(a, t0, t1); }
}  // namespace clover
#endif
