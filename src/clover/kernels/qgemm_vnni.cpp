// Integer-dot path of the quantized matmul for short passes (an AR step, a verify pass: 1 to 4
// rows, 16 with x on one plane, run_x8): x is rounded to integers per group of k and `vpdpbusd`
// (AVX-512 VNNI) multiplies 16 weight rows x 4 k of bytes by 4 bytes of x broadcast, 64
// multiply-adds an instruction, summed exactly in int32. The bfloat16 path spends two
// instructions per pair of k unpacking 4-bit levels (shift, table lookup) beside one
// `vdpbf16ps` of 32 multiply-adds, so one row takes several times as long as reading the
// weights; here a 64-byte chunk of 4-bit levels unpacks into bytes with three instructions for
// four `vpdpbusd` (two planes of x, below).
//
// x in 8 bits per group (llama.cpp's Q8_0 activations) is too coarse for some models: one
// outlier sets the step of its 31 neighbours, and a small model's next-token KL against
// float32 grows about tenfold over bfloat16 x (docs/kernels.md). So x_q = round(x / d) in -16256..16256,
// d = max |x| / 16256 (15 bits a value), split into two int8 planes, x_q = 128 high + low
// (high in -127..127, low in -64..63), each dotted with the levels:
//   y[m, n] = sum_g  scale[n, g] * d[m, g] * (128 dot_g(high, q[n]) + dot_g(low, q[n]))
//             + low[n, g] * xsum[m, g]
// (xsum: the bfloat16 x's sums, as on the other paths). The dots are exact, so a row's result
// does not depend on the pass it is in: an AR step and a verify pass agree to the bit.
//
// The weights stay in qgemm.h's layouts; x is written in the order they want:
//   int4: 32-bit lane n of a 64-byte chunk c holds row n's 8 levels at k = 8c..8c+7, nibbles
//     in the order k = 0, 2, 4, 6, 1, 3, 5, 7 (two words); `& 0x0f` per byte gives the bytes
//     of k = 0, 4, 1, 5, `>> 4 & 0x0f` those of k = 2, 6, 3, 7, so x is stored in that order.
//   int5: the int4 bytes, + 16 where the pair's mask has the word's high bit (`_pdep_u64`
//     spreads two pairs' 32-bit masks over the 64 bytes), and dot -= 16 sum(x_q).
//   int6: the same with two masks (+ 16, + 32), and dot -= 32 sum(x_q): on 15-bit x the dot
//     equals the one of the same levels stored as int8, so both give the same results to the
//     bit; with x on 8 bits (kX8) int6 takes one plane as int4 and int5 do, int8 keeps two.
//   int8: two pairs (64 bytes) hold rows 0..15 x (k, k+1) then rows 0..15 x (k+2, k+3); one
//     `vpermw` puts row n's 4 bytes in lane n. Levels are signed, `vpdpbusd` wants its first
//     operand unsigned: levels + 128 (a xor), and dot -= 128 sum(x_q).
// |dot| < 32 x 255 x 16256 x 2: no int32 overflow.
#include <algorithm>
#include <cstring>
#include <limits>

#include "qgemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2,f16c,fma")
#endif
#include <immintrin.h>

#include "simd512.h"

namespace clover {
namespace {

// groups of weights ahead to prefetch: a model larger than the share of L3 it gets streams
// from DRAM, where the hardware prefetcher alone leaves an AR step slower than 4 to 16
// groups of software prefetch do
constexpr int64_t kAhead = 8;

// int5, int6: lo and hi (the & 15 and >> 4 bytes of chunk c of a tile's group) + `value`
// where the level's bit is set in the masks at `masks` (16 for int5's high bit, 16 and 32 for
// int6's two), so levels + 16 in 0..31, levels + 32 in 0..63: pairs 4c..4c+3 hold bit w of
// word w; byte 4n + b of lo holds word 2n + b / 2 of pair 4c + 2 (b % 2)
CLOVER_INLINE void add_high_bits(const uint8_t* masks, int c, int value, __m512i& lo,
                                 __m512i& hi) {
  uint32_t m[4];
  std::memcpy(m, masks + 16 * c, 16);
  const uint64_t even = 0x5555555555555555ull, odd = ~even;
  const __mmask64 mlo = _pdep_u64(m[0], even) | _pdep_u64(m[2], odd);
  const __mmask64 mhi = _pdep_u64(m[1], even) | _pdep_u64(m[3], odd);
  const __m512i v = _mm512_set1_epi8(static_cast<char>(value));
  lo = _mm512_mask_add_epi8(lo, mlo, lo, v);
  hi = _mm512_mask_add_epi8(hi, mhi, hi, v);
}

// y (tile t's 16 outputs of MR rows) + bias -> the output rows
template <int MR>
CLOVER_INLINE void store_rows(const QGemm& a, int64_t t, const __m512* y) {
  for (int r = 0; r < MR; ++r) {
    __m512 v = y[r];
    if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + 16 * t));
    const int64_t o = r * a.out_stride() + 16 * t;
    if (a.out_f32) {
      _mm512_storeu_ps(a.out_f32 + o, v);
    } else {
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int i = 0; i < 16; ++i) a.out_bf16[o + i] = to_bf16(f[i]);
    }
  }
}

// MR rows of x against tiles [t0, t1): per group, integer dots in two chains per row and plane
// (even and odd quads of k), then y += dot * scale * d (+ low * xsum). The same operations in
// the same order for every MR: a row's result does not depend on the rows beside it.
template <int MR, int BITS, int GROUP, bool LOW, bool F16>
void run(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / GROUP;
  constexpr int64_t tile = tile_bytes(BITS, GROUP);
  constexpr int kBias = BITS == 4 ? 0 : BITS == 5 ? 16 : BITS == 6 ? 32 : 128;  // level + this
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i rows_of_quads = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                 18, 2, 17, 1, 16, 0);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 y[MR];
    for (int r = 0; r < MR; ++r) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* base = a.q + (t * G + g) * tile;
      for (int64_t at = kAhead * tile; at < (kAhead + 1) * tile; at += 64)  // may pass the end:
        _mm_prefetch(reinterpret_cast<const char*>(base + at), _MM_HINT_T0);  // never faults
      const int8_t* x = a.xq + g * GROUP;  // row r: high plane at x + 2rK, low plane K after
      __m512i acc[MR][4];  // high plane: chains 0 and 1, low plane: 2 and 3
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_si512();
      if (BITS != 8) {
        for (int c = 0; c < GROUP / 8; ++c) {
          const __m512i v = _mm512_loadu_si512(base + 64 * c);
          __m512i lo = _mm512_and_si512(v, nib);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          if (BITS == 5) add_high_bits(base + mask_offset(32, 0), c, 16, lo, hi);
          if (BITS == 6) {
            add_high_bits(base + mask_offset(16, 0), c, 16, lo, hi);
            add_high_bits(base + mask_offset(16, 1), c, 32, lo, hi);
          }
          for (int r = 0; r < MR; ++r)
            for (int pl = 0; pl < 2; ++pl) {
              const int8_t* xp = x + (2 * r + pl) * K + 8 * c;
              acc[r][2 * pl] = _mm512_dpbusd_epi32(acc[r][2 * pl], lo, broadcast4(xp));
              acc[r][2 * pl + 1] = _mm512_dpbusd_epi32(acc[r][2 * pl + 1], hi, broadcast4(xp + 4));
            }
        }
      } else {
        for (int c = 0; c < GROUP / 4; c += 2) {  // quads of k (two pairs of the layout) in
          for (int e = 0; e < 2; ++e) {             // twos: each chain's index a constant, so
            const int8_t* xc = x + 4 * (c + e);     // the accumulators stay in registers
            const __m512i v = _mm512_loadu_si512(base + 64 * (c + e));
            const __m512i w = _mm512_xor_si512(_mm512_permutexvar_epi16(rows_of_quads, v), flip);
            for (int r = 0; r < MR; ++r)
              for (int pl = 0; pl < 2; ++pl)
                acc[r][2 * pl + e] =
                    _mm512_dpbusd_epi32(acc[r][2 * pl + e], w, broadcast4(xc + (2 * r + pl) * K));
          }
        }
      }
      __m512 s, l;
      scales16<F16, LOW>(a, t, G, g, s, l);
      for (int r = 0; r < MR; ++r) {
        __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), 7),
                                       _mm512_add_epi32(acc[r][2], acc[r][3]));
        if (kBias) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(kBias * a.xqs[r * G + g]));
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(a.xd[r * G + g]));
        y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, y[r]);
        if (LOW) y[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * G + g]), l, y[r]);
      }
    }
    store_rows<MR>(a, t, y);
  }
}

// 4- to 6-bit levels with x on one 8-bit plane (kernel path flag kX8, quantize_rows_avx2's
// planes 1: x_q in -127..127 in the order above): half the `vpdpbusd` of two planes, so a
// row costs two an unpacked chunk and up to 8 rows share one unpacking. The dots are exact
// and the epilogue is qgemm_dots_avx2.cpp's, lane for lane, so a row's result equals that
// path's to the bit; this one needs fewer instructions a chunk than that one at one row, and
// keeps passes of 5 to 16 rows off the bfloat16 path. Up to 4 rows take two chains a row (the
// chunk's low and high nibbles), then one: enough independent sums either way, and 8 rows'
// sums + outputs fit the registers.
template <int MR, int BITS, bool LOW, bool F16>
void run_x8(const QGemm& a, int64_t t0, int64_t t1) {
  constexpr int GROUP = BITS == 6 ? 16 : 32;
  const int64_t K = a.K, G = K / GROUP;
  constexpr int64_t tile = tile_bytes(BITS, GROUP);
  constexpr int CH = MR <= 4 ? 2 : 1;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 y[MR];
    for (int r = 0; r < MR; ++r) y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* base = a.q + (t * G + g) * tile;
      for (int64_t at = kAhead * tile; at < (kAhead + 1) * tile; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(base + at), _MM_HINT_T0);
      const int8_t* x = a.xq + g * GROUP;  // row r at x + rK
      __m512i acc[MR][CH];
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < CH; ++i) acc[r][i] = _mm512_setzero_si512();
      for (int c = 0; c < GROUP / 8; ++c) {
        const __m512i v = _mm512_loadu_si512(base + 64 * c);
        __m512i lo = _mm512_and_si512(v, nib);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        if (BITS == 5) add_high_bits(base + mask_offset(32, 0), c, 16, lo, hi);
        if (BITS == 6) {
          add_high_bits(base + mask_offset(16, 0), c, 16, lo, hi);
          add_high_bits(base + mask_offset(16, 1), c, 32, lo, hi);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* xp = x + r * K + 8 * c;
          acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], lo, broadcast4(xp));
          acc[r][CH - 1] = _mm512_dpbusd_epi32(acc[r][CH - 1], hi, broadcast4(xp + 4));
        }
      }
      __m512 s, l;
      scales16<F16, LOW>(a, t, G, g, s, l);
      for (int r = 0; r < MR; ++r) {
        __m512i dot = CH == 2 ? _mm512_add_epi32(acc[r][0], acc[r][CH - 1]) : acc[r][0];
        if (BITS != 4)  // levels + 16 (int5), + 32 (int6)
          dot = _mm512_sub_epi32(dot, _mm512_set1_epi32((BITS == 5 ? 16 : 32) * a.xqs[r * G + g]));
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(a.xd[r * G + g]));
        y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, y[r]);
        if (LOW) y[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.xsum[r * G + g]), l, y[r]);
      }
    }
    store_rows<MR>(a, t, y);
  }
}

}  // namespace

void quantize_rows(const uint16_t* xb, int64_t M, int64_t K, int group, int bits, int8_t* xq,
                   float* xd, int32_t* xqs) {
  // 4- to 6-bit weights: each 8 k in the order 0, 4, 1, 5, 2, 6, 3, 7 (the file's header)
  const __m512i order = bits == 8 ? _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                     3, 2, 1, 0)
                                  : _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2,
                                                     5, 1, 4, 0);
  const __m512i lo = _mm512_set1_epi32(-kXMax), hi = _mm512_set1_epi32(kXMax);
  const int64_t G = K / group;
  const int n = group / 16;  // vectors of 16 a group: 1 or 2
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* x = xb + m * K + g * group;
      __m512 v[2];
      __m512 amax = _mm512_setzero_ps();
      __mmask16 nan = 0;  // max_ps drops NaNs: a NaN in x makes d NaN, so its rows come out NaN
      for (int i = 0; i < n; ++i) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * i));
        v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
      }
      const float top = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(top > 0.f ? static_cast<float>(kXMax) / top : 0.f);
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < n; ++i) {  // round half to even (the default rounding mode)
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutexvar_ps(order, v[i]), inv));
        q = _mm512_max_epi32(lo, _mm512_min_epi32(q, hi));
        sum = _mm512_add_epi32(sum, q);
        const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(64)), 7);
        const __m512i low = _mm512_sub_epi32(q, _mm512_slli_epi32(high, 7));
        int8_t* out = xq + 2 * m * K + g * group + 16 * i;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(high));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + K), _mm512_cvtepi32_epi8(low));
      }
      xd[m * G + g] =
          nan ? std::numeric_limits<float>::quiet_NaN() : top / static_cast<float>(kXMax);
      xqs[m * G + g] = _mm512_reduce_add_epi32(sum);
    }
}

void qgemm_tiles_vnni(const QGemm& a, int64_t t0, int64_t t1) {
  // two planes: up to 4 rows a block (their 16 sums fill half the registers); one plane (4-
  // and 5-bit weights, kX8): up to 8. A pass of one block runs the tiles in a stream; wider
  // passes take each tile's blocks in turn, so the tile comes from L1/L2 after the first
  const int block = a.x_planes == 1 ? 8 : 4;
  const auto rows = [&](const QGemm& b, int64_t u0, int64_t u1) {
    dispatch_format(b, [&](auto P, auto BITS, auto LOW, auto F16) {
      constexpr int bits = decltype(BITS)::value, group = 2 * decltype(P)::value;
      constexpr bool low = decltype(LOW)::value, f16 = decltype(F16)::value;
      if constexpr (bits != 8) {
        if (b.x_planes == 1) {
          switch (b.M) {
            case 1: return run_x8<1, bits, low, f16>(b, u0, u1);
            case 2: return run_x8<2, bits, low, f16>(b, u0, u1);
            case 3: return run_x8<3, bits, low, f16>(b, u0, u1);
            case 4: return run_x8<4, bits, low, f16>(b, u0, u1);
            case 5: return run_x8<5, bits, low, f16>(b, u0, u1);
            case 6: return run_x8<6, bits, low, f16>(b, u0, u1);
            case 7: return run_x8<7, bits, low, f16>(b, u0, u1);
            default: return run_x8<8, bits, low, f16>(b, u0, u1);
          }
        }
      }
      switch (b.M) {
        case 1: return run<1, bits, group, low, f16>(b, u0, u1);
        case 2: return run<2, bits, group, low, f16>(b, u0, u1);
        case 3: return run<3, bits, group, low, f16>(b, u0, u1);
        default: return run<4, bits, group, low, f16>(b, u0, u1);
      }
    });
  };
  if (a.M <= block) return rows(a, t0, t1);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < a.M; r0 += block)
      rows(row_block(a, r0, std::min<int64_t>(block, a.M - r0)), t, t + 1);
}

}  // namespace clover

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else  // not x86-64: never selected (ops.cpp checks the CPU)
namespace clover {
void qgemm_tiles_vnni(const QGemm& a, int64_t t0, int64_t t1) { qgemm_tiles_scalar(a, t0, t1); }
void quantize_rows(const uint16_t*, int64_t, int64_t, int, int, int8_t*, float*, int32_t*) {}
}  // namespace clover
#endif
