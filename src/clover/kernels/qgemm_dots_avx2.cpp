// Integer-dot path for passes of 1 to 16 rows on AVX2 CPUs without AVX-512 (qgemm_vnni.cpp's
// twin, which takes 1 to 4): the same x rounded to 15 bits per group, the same exact integer
// dots, the same float epilogue in the same order, so a result here equals the VNNI path's to
// the bit. Rows go in blocks of up to 4 (their sums fill the 16 registers). The float
// path (qgemm_avx2.cpp) widens every 4-bit level to float32 and spends ~4 instructions on each
// 8 multiply-adds of one row; here 32 bytes of levels unpack into 64 bytes with three.
//
// No `vpdpbusd` on AVX2: `vpmaddubsw` multiplies unsigned bytes by signed bytes and adds
// neighbours into int16 (saturating), `vpmaddwd` against ones widens to int32.
//   int4 / int5: x as qgemm_vnni.cpp's two int8 planes and byte order. A 256-bit half of a
//     64-byte chunk holds rows 8h..8h+7 (a row's 4 bytes in its 32-bit lane), so each int16
//     lane sums two products of one row. They stay in int16 over a span of chunks, then widen:
//     |level| <= 15 (int4), 31 (int5: levels + 16), |x| <= 127 (high plane), so 16 products
//     (int4: the whole group of 32) or 8 (int5: two chunks) stay under 32767.
//   int6 (groups of 16): the int5 way with two masks, levels + 32 <= 63: 4 products (one chunk)
//     at a time, x on one plane or two as int4's.
//   int4 / int5 with x on one plane (`x_planes` 1, kernel path flag kX8): x rounded to 8 bits
//     per group (-127..127, as llama.cpp's Q8 activations), half the multiplies a row; the
//     same spans (|x| <= 127 as the high plane's).
//   int8: levels are signed (-128..127), so `vpmaddubsw` cannot take them without overflow;
//     x is written as int16 (x_q itself, qgemm_rows's buffer of two planes holds it) and
//     `vpmaddwd` multiplies a pair's levels widened to int16 (rows 0..7 and 8..15 x (k, k+1),
//     qgemm.h's layout as it is) by the pair of x: int32 lane n = row n's two products.
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
#include <limits>

#include "qgemm.h"

#define CLOVER_INLINE inline __attribute__((always_inline))

namespace clover {
namespace {

constexpr int64_t kAhead = 8;  // groups of weights ahead to prefetch (qgemm_vnni.cpp)

CLOVER_INLINE __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// 8 scales (or lows) of rows 8h..8h+7 of a tile's group, stored in float16 or float32
template <bool F16>
CLOVER_INLINE __m256 load8(const void* p, int64_t at) {
  if (F16)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at)));
  return _mm256_loadu_ps(static_cast<const float*>(p) + at);
}

// int5's high bits as bytes, 16 where the level has it, for half h of a chunk. `m` holds the
// chunk's 4 pair masks (bit w of pair 4c + j's mask: word w's nibble j) in both 128-bit
// lanes. Byte 2i of a half is word 16h + i's low byte (nibbles 0 and 1: pairs 4c and 4c + 1),
// byte 2i + 1 its high byte (pairs 4c + 2 and 4c + 3); lo (& 15) bytes take the even pairs'
// bits, hi (>> 4) bytes the odd ones'. One shuffle puts in byte 2i the byte of the right mask
// holding bit i (bits 16h + 0..7 in the low lane, 16h + 8..15 in the high), then a compare
// picks bit i % 8.
template <int H, bool ODD, int V = 16>
CLOVER_INLINE __m256i high16(__m256i m) {
  constexpr char a = 4 * ODD + 2 * H, b = 8 + 4 * ODD + 2 * H;  // mask bytes: pair 4c+ODD, +2
  const __m256i pick = _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,  //
                                        a + 1, b + 1, a + 1, b + 1, a + 1, b + 1, a + 1, b + 1,
                                        a + 1, b + 1, a + 1, b + 1, a + 1, b + 1, a + 1, b + 1);
  const __m256i bit = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128,
                                       -128, 1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64,
                                       -128, -128);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(m, pick), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(V));  // V: 16, or 32 for int6's bit 5
}

// y[r] (rows 8h..8h+7) += dot * scale * d (+ low * xsum): qgemm_vnni.cpp's epilogue, 8 lanes.
// G (groups a row) comes from the caller: computed here, K / group would be a 64-bit division
// per group and half.
template <int MR, bool LOW, bool F16>
CLOVER_INLINE void epilogue(const QGemm& a, int64_t G, int64_t t, int64_t g, int h,
                            const __m256i* dot, __m256* y) {
  constexpr int64_t per = LOW ? 32 : 16;
  const int64_t at = (t * G + g) * per + 8 * h;
  __m256 s, l = _mm256_setzero_ps();
  if (a.mults != nullptr) {  // compact scales: float32(mult) * base (qgemm.h)
    const int64_t bt = ((t * G >> a.base_shift) + (g >> a.base_shift)) * per + 8 * h;
    const auto mult = [&](int64_t i) {
      const __m128i m = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.mults + i));
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m));
    };
    s = _mm256_mul_ps(mult(at), _mm256_loadu_ps(a.bases + bt));
    if (LOW) l = _mm256_mul_ps(mult(at + 16), _mm256_loadu_ps(a.bases + bt + 16));
  } else {
    s = load8<F16>(a.scales, at);
    if (LOW) l = load8<F16>(a.scales, at + 16);
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(a.xd[r * G + g]));
    y[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), sd, y[r]);
    if (LOW) y[r] = _mm256_fmadd_ps(_mm256_set1_ps(a.xsum[r * G + g]), l, y[r]);
  }
}

template <int MR>
CLOVER_INLINE void store(const QGemm& a, int64_t t, int h, __m256* y) {
  for (int r = 0; r < MR; ++r) {
    __m256 v = y[r];
    if (a.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a.bias + 16 * t + 8 * h));
    const int64_t o = r * a.out_stride() + 16 * t + 8 * h;
    if (a.out_f32) {
      _mm256_storeu_ps(a.out_f32 + o, v);
    } else {
      alignas(32) float f[8];
      _mm256_store_ps(f, v);
      for (int i = 0; i < 8; ++i) a.out_bf16[o + i] = to_bf16(f[i]);
    }
  }
}

// 4- and 5-bit levels (groups of 32) and 6-bit ones (groups of 16), MR rows of x on PL int8
// planes. Up to 2 rows (4 rows of int4 with x on one plane) take both halves of the tile at
// once: each broadcast of x then serves 16 weight rows, which makes 3- to 16-row int4 passes
// faster (int5's high bits and x on two planes fill the registers: 3 or 4 rows, one half after
// the other).
template <int MR, int BITS, bool LOW, bool F16, int PL>
void run_nibbles(const QGemm& a, int64_t t0, int64_t t1) {
  constexpr int GROUP = BITS == 6 ? 16 : 32;
  const int64_t K = a.K, G = K / GROUP;
  constexpr int64_t tile = tile_bytes(BITS, GROUP);
  constexpr int span = BITS == 4 ? 4 : BITS == 5 ? 2 : 1;  // chunks summed in int16, then widened
  constexpr int HN = MR <= 2 || (BITS == 4 && MR * PL <= 4) ? 2 : 1;  // halves a pass
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int64_t t = t0; t < t1; ++t)
    for (int h0 = 0; h0 < 2; h0 += HN) {  // rows 8h..8h+7 of the tile, h = h0 + i
      __m256 y[HN][MR];
      for (int i = 0; i < HN; ++i)
        for (int r = 0; r < MR; ++r) y[i][r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* base = a.q + (t * G + g) * tile;
        if (h0 == 0)  // a second half reads the lines the first one brought in
          for (int64_t at = kAhead * tile; at < (kAhead + 1) * tile; at += 64)
            _mm_prefetch(reinterpret_cast<const char*>(base + at), _MM_HINT_T0);
        const int8_t* x = a.xq + g * GROUP;  // row r: (high) plane at x + PL rK, low one K on
        __m256i acc[HN][MR][PL];  // int32 per half, row and plane
        for (int i = 0; i < HN; ++i)
          for (int r = 0; r < MR; ++r)
            for (int pl = 0; pl < PL; ++pl) acc[i][r][pl] = _mm256_setzero_si256();
        for (int c0 = 0; c0 < GROUP / 8; c0 += span) {
          __m256i part[HN][MR][PL];  // int16 sums over the span
          for (int i = 0; i < HN; ++i)
            for (int r = 0; r < MR; ++r)
              for (int pl = 0; pl < PL; ++pl) part[i][r][pl] = _mm256_setzero_si256();
          // a chunk at a time: unrolled, GCC hoisted all 64 products of a group ahead of
          // their sums and kept them on the stack
#pragma GCC unroll 1
          for (int c = c0; c < c0 + span; ++c) {
            __m256i lo[HN], hi[HN], m = _mm256_setzero_si256(), m5 = m;
            const auto masks = [&](int64_t at) {  // the chunk's 4 pair masks, in both lanes
              return _mm256_broadcastsi128_si256(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + at + 16 * c)));
            };
            if (BITS == 5) m = masks(mask_offset(32, 0));
            if (BITS == 6) m = masks(mask_offset(16, 0)), m5 = masks(mask_offset(16, 1));
            for (int i = 0; i < HN; ++i) {
              const int h = h0 + i;
              const __m256i v =
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64 * c + 32 * h));
              lo[i] = _mm256_and_si256(v, nib);
              hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
              if (BITS != 4) {  // levels + 16 in 0..31 (int5), + 32 in 0..63 (int6)
                lo[i] = _mm256_or_si256(lo[i], h ? high16<1, false>(m) : high16<0, false>(m));
                hi[i] = _mm256_or_si256(hi[i], h ? high16<1, true>(m) : high16<0, true>(m));
              }
              if (BITS == 6) {
                lo[i] = _mm256_or_si256(lo[i],
                                        h ? high16<1, false, 32>(m5) : high16<0, false, 32>(m5));
                hi[i] = _mm256_or_si256(hi[i],
                                        h ? high16<1, true, 32>(m5) : high16<0, true, 32>(m5));
              }
            }
            for (int r = 0; r < MR; ++r)
              for (int pl = 0; pl < PL; ++pl) {
                const int8_t* xp = x + (PL * r + pl) * K + 8 * c;
                const __m256i xl = broadcast4(xp), xh = broadcast4(xp + 4);
                for (int i = 0; i < HN; ++i) {
                  const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo[i], xl),
                                                     _mm256_maddubs_epi16(hi[i], xh));
                  part[i][r][pl] = _mm256_add_epi16(part[i][r][pl], d);
                }
              }
          }
          for (int i = 0; i < HN; ++i)
            for (int r = 0; r < MR; ++r)
              for (int pl = 0; pl < PL; ++pl)
                acc[i][r][pl] =
                    _mm256_add_epi32(acc[i][r][pl], _mm256_madd_epi16(part[i][r][pl], ones));
        }
        for (int i = 0; i < HN; ++i) {
          __m256i dot[MR];
          for (int r = 0; r < MR; ++r) {
            dot[r] = acc[i][r][0];  // one plane: x_q itself; two: 128 high + low
            if (PL == 2) dot[r] = _mm256_add_epi32(_mm256_slli_epi32(dot[r], 7), acc[i][r][PL - 1]);
            if (BITS != 4)
              dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32((BITS == 5 ? 16 : 32) *
                                                                  a.xqs[r * G + g]));
          }
          epilogue<MR, LOW, F16>(a, G, t, g, h0 + i, dot, y[i]);
        }
      }
      for (int i = 0; i < HN; ++i) store<MR>(a, t, h0 + i, y[i]);
    }
}

// 8-bit levels (groups of 16 or 32), MR rows of x as int16
template <int MR, int GROUP, bool LOW, bool F16>
void run_bytes(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / GROUP;
  constexpr int64_t tile = 16 * GROUP;
  const int16_t* xs = reinterpret_cast<const int16_t*>(a.xq);  // [M, K]
  for (int64_t t = t0; t < t1; ++t) {
    __m256 y[2][MR];
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < MR; ++r) y[h][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* base = a.q + (t * G + g) * tile;
      for (int64_t at = kAhead * tile; at < (kAhead + 1) * tile; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + at), _MM_HINT_T0);
      __m256i acc[2][MR];
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) acc[h][r] = _mm256_setzero_si256();
      for (int p = 0; p < GROUP / 2; ++p) {
        const __m128i* v = reinterpret_cast<const __m128i*>(base + 32 * p);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(v));      // rows 0..7
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(v + 1));  // rows 8..15
        for (int r = 0; r < MR; ++r) {
          const __m256i bx = broadcast4(xs + r * K + g * GROUP + 2 * p);
          acc[0][r] = _mm256_add_epi32(acc[0][r], _mm256_madd_epi16(w0, bx));
          acc[1][r] = _mm256_add_epi32(acc[1][r], _mm256_madd_epi16(w1, bx));
        }
      }
      for (int h = 0; h < 2; ++h) epilogue<MR, LOW, F16>(a, G, t, g, h, acc[h], y[h]);
    }
    for (int h = 0; h < 2; ++h) store<MR>(a, t, h, y[h]);
  }
}

template <int MR>
void run_rows(const QGemm& a, int64_t t0, int64_t t1) {
  dispatch_format(a, [&](auto P, auto BITS, auto LOW, auto F16) {
    constexpr int bits = decltype(BITS)::value, group = 2 * decltype(P)::value;
    constexpr bool low = decltype(LOW)::value, f16 = decltype(F16)::value;
    if constexpr (bits == 8)
      run_bytes<MR, group, low, f16>(a, t0, t1);
    else if (a.x_planes == 1)
      run_nibbles<MR, bits, low, f16, 1>(a, t0, t1);
    else
      run_nibbles<MR, bits, low, f16, 2>(a, t0, t1);
  });
}

}  // namespace

void quantize_rows_avx2(const uint16_t* xb, int64_t M, int64_t K, int group, int bits,
                        int8_t* xq, float* xd, int32_t* xqs, int planes) {
  // 4- to 6-bit weights: two int8 planes (or, planes 1, x_q in -127..127 on one), each 8 k in
  // the order 0, 4, 1, 5, 2, 6, 3, 7; 8-bit weights: x_q as int16 in k's order (the same 2K
  // bytes a row)
  const bool one = bits != 8 && planes == 1;
  const int xmax = one ? 127 : kXMax;
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i lo = _mm256_set1_epi32(-xmax), hi = _mm256_set1_epi32(xmax);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const int64_t G = K / group;
  const int n = group / 8;  // vectors of 8 a group: 2 or 4
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* x = xb + m * K + g * group;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int i = 0; i < n; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float top = _mm_cvtss_f32(m4);
      const __m256 inv = _mm256_set1_ps(top > 0.f ? static_cast<float>(xmax) / top : 0.f);
      __m256i sum = _mm256_setzero_si256();
      for (int i = 0; i < n; ++i) {  // round half to even (the default rounding mode)
        const __m256 xi = bits == 8 ? v[i] : _mm256_permutevar8x32_ps(v[i], order);
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(xi, inv));
        q = _mm256_max_epi32(lo, _mm256_min_epi32(q, hi));
        sum = _mm256_add_epi32(sum, q);
        alignas(32) int32_t qs[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(qs), q);
        if (bits == 8) {
          int16_t* out = reinterpret_cast<int16_t*>(xq) + m * K + g * group + 8 * i;
          for (int j = 0; j < 8; ++j) out[j] = static_cast<int16_t>(qs[j]);
        } else if (one) {
          int8_t* out = xq + m * K + g * group + 8 * i;
          for (int j = 0; j < 8; ++j) out[j] = static_cast<int8_t>(qs[j]);
        } else {
          int8_t* out = xq + 2 * m * K + g * group + 8 * i;
          for (int j = 0; j < 8; ++j) {
            const int high = (qs[j] + 64) >> 7;
            out[j] = static_cast<int8_t>(high);
            out[j + K] = static_cast<int8_t>(qs[j] - (high << 7));
          }
        }
      }
      xd[m * G + g] = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN()
                                              : top / static_cast<float>(xmax);
      alignas(32) int32_t s8[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
      xqs[m * G + g] = s8[0] + s8[1] + s8[2] + s8[3] + s8[4] + s8[5] + s8[6] + s8[7];
    }
}

void qgemm_tiles_dots_avx2(const QGemm& a, int64_t t0, int64_t t1) {
  // rows in blocks of 4 (the accumulators of 4 fill the registers), tile by tile so that a
  // tile's weights come from L1/L2 for the blocks after the first; each row's result is the
  // same in any block
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < a.M; r0 += 4) {
      const QGemm b = row_block(a, r0, std::min<int64_t>(4, a.M - r0));
      switch (b.M) {
        case 1: run_rows<1>(b, t, t + 1); break;
        case 2: run_rows<2>(b, t, t + 1); break;
        case 3: run_rows<3>(b, t, t + 1); break;
        default: run_rows<4>(b, t, t + 1); break;
      }
    }
}

}  // namespace clover

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else  // not x86-64: never selected (ops.cpp checks the CPU)
#include "qgemm.h"
namespace clover {
void qgemm_tiles_dots_avx2(const QGemm& a, int64_t t0, int64_t t1) { qgemm_tiles_scalar(a, t0, t1); }
void quantize_rows_avx2(const uint16_t*, int64_t, int64_t, int, int, int8_t*, float*, int32_t*,
                        int) {}
}  // namespace clover
#endif
