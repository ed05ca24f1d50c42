// AVX-512 (BF16) path of the quantized matmul: one `vdpbf16ps` multiplies 16 weight rows x a
// pair of k by the same pair of x values (broadcast), accumulating in float32. A weight tile
// (16 rows x one group) is unpacked into registers once and then used for every row of x, 8
// rows at a time so that 8 independent accumulator chains hide the instruction's latency.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "qgemm.h"
#include "simd512.h"

namespace clover {
namespace {

// bfloat16 bit patterns of 0..15, twice: vpermw reads 5 index bits, the 5th of which is the
// next nibble's lowest bit, so index i and i + 16 must give the same level.
CLOVER_INLINE __m512i nibble_table() {
  alignas(64) static const uint16_t t[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  return _mm512_load_si512(t);
}

// bfloat16 bit patterns of -16..15: a 5-bit level's index (nibble + 16 x high bit) maps to
// its value
CLOVER_INLINE __m512i signed5_table() {
  alignas(64) static const uint16_t t[32] = {
      0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130, 0xc120, 0xc110,
      0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  return _mm512_load_si512(t);
}

// bfloat16 bit patterns of -32..31 in two halves (`vpermt2w` reads 6 index bits: level + 32)
CLOVER_INLINE void signed6_tables(__m512i& lo, __m512i& hi) {
  alignas(64) static const uint16_t t[64] = {
      0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8,
      0xc1c0, 0xc1b8, 0xc1b0, 0xc1a8, 0xc1a0, 0xc198, 0xc190, 0xc188,
      0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130, 0xc120, 0xc110,
      0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8, 0x41b0, 0x41b8,
      0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8};
  lo = _mm512_load_si512(t);
  hi = _mm512_load_si512(t + 32);
}

// Pair p of a tile as a vector of [16 rows x 2 k] bfloat16 levels.
// int4 (256 bytes): chunk p / 4 holds pairs 4c..4c+3, one nibble of every word each.
// int5 (320 bytes): the int4 layout of the low 4 bits, then one 32-bit mask per pair whose
// bit w is the high bit of word w's level: index = nibble | 16 x bit, read in the -16..15 table.
template <int BITS>
CLOVER_INLINE __m512i unpack_pair(const uint8_t* base, int p, __m512i table) {
  if (BITS == 4) {
    const __m512i v = _mm512_loadu_si512(base + 64 * (p / 4));
    return _mm512_permutexvar_epi16(p % 4 ? _mm512_srli_epi16(v, 4 * (p % 4)) : v, table);
  }
  if (BITS == 5) {
    const __m512i v = _mm512_loadu_si512(base + 64 * (p / 4));
    __m512i nib = p % 4 ? _mm512_srli_epi16(v, 4 * (p % 4)) : v;
    nib = _mm512_and_si512(nib, _mm512_set1_epi16(15));
    uint32_t high;
    std::memcpy(&high, base + mask_offset(32, 0) + 4 * p, 4);
    nib = _mm512_mask_add_epi16(nib, static_cast<__mmask32>(high), nib, _mm512_set1_epi16(16));
    return _mm512_permutexvar_epi16(nib, table);
  }
  if (BITS == 6) {  // int6 (192 bytes): as int5, with masks of bit 4 then of bit 5
    const __m512i v = _mm512_loadu_si512(base + 64 * (p / 4));
    __m512i idx = p % 4 ? _mm512_srli_epi16(v, 4 * (p % 4)) : v;
    idx = _mm512_and_si512(idx, _mm512_set1_epi16(15));
    uint32_t b4, b5;
    std::memcpy(&b4, base + mask_offset(16, 0) + 4 * p, 4);
    std::memcpy(&b5, base + mask_offset(16, 1) + 4 * p, 4);
    idx = _mm512_mask_add_epi16(idx, static_cast<__mmask32>(b4), idx, _mm512_set1_epi16(16));
    idx = _mm512_mask_add_epi16(idx, static_cast<__mmask32>(b5), idx, _mm512_set1_epi16(32));
    __m512i lo, hi;
    signed6_tables(lo, hi);
    return _mm512_permutex2var_epi16(lo, idx, hi);
  }
  // int8 (32 bytes a pair): |level| <= 127 is exact in bfloat16
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// MB rows of x against one tile; NA accumulators per row split the chain over k. The tile's
// pairs come unpacked from `wbuf` (several row blocks share one unpacking) or, when wbuf is
// null, are unpacked on the fly (one block: nothing to share, no store and reload).
// y [MB, 16] += scale * dot + low * xsum
template <int MB, int NA, int P, int BITS, bool LOW>
CLOVER_INLINE void micro(const uint8_t* base, const __m512i* wbuf, __m512i table, __m512 s,
                         __m512 l, const uint16_t* x, int64_t K, const float* xs, int64_t G,
                         float* y) {
  __m512 acc[MB][NA];
  for (int r = 0; r < MB; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512i w = wbuf ? _mm512_load_si512(wbuf + p) : unpack_pair<BITS>(base, p, table);
    for (int r = 0; r < MB; ++r)
      acc[r][p % NA] =
          _mm512_dpbf16_ps(acc[r][p % NA], (__m512bh)w, (__m512bh)broadcast4(x + r * K + 2 * p));
  }
  for (int r = 0; r < MB; ++r) {
    __m512 d = acc[r][0];
    for (int a = 1; a < NA; ++a) d = _mm512_add_ps(d, acc[r][a]);
    __m512 yr = _mm512_fmadd_ps(d, s, _mm512_loadu_ps(y + 16 * r));
    if (LOW) yr = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G]), l, yr);
    _mm512_storeu_ps(y + 16 * r, yr);
  }
}

// rows of x per block: 12 independent accumulator chains keep the dot unit busy (8 leave it
// idle part of the time)
constexpr int64_t kRowBlock = 12;

template <int P, int BITS, bool LOW>
CLOVER_INLINE void rows(int64_t mc, const uint8_t* base, __m512i* wbuf, __m512i table, __m512 s,
                        __m512 l, const uint16_t* x, int64_t K, const float* xs, int64_t G,
                        float* y) {
  const __m512i* wb = nullptr;
  if (mc > kRowBlock) {  // several blocks of rows: unpack once into wbuf
    for (int p = 0; p < P; ++p) _mm512_store_si512(wbuf + p, unpack_pair<BITS>(base, p, table));
    wb = wbuf;
  }
  int64_t r = 0;
  for (; r + kRowBlock <= mc; r += kRowBlock)
    micro<kRowBlock, 1, P, BITS, LOW>(base, wb, table, s, l, x + r * K, K, xs + r * G, G,
                                      y + 16 * r);
  x += r * K, xs += r * G, y += 16 * r;
  switch (mc - r) {
    case 1: micro<1, 4, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 2: micro<2, 2, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 3: micro<3, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 4: micro<4, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 5: micro<5, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 6: micro<6, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 7: micro<7, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 8: micro<8, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 9: micro<9, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 10: micro<10, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    case 11: micro<11, 1, P, BITS, LOW>(base, wb, table, s, l, x, K, xs, G, y); break;
    default: break;
  }
}

// row `row` of the output, columns of tile t: v + bias
CLOVER_INLINE void store_row(const QGemm& a, int64_t t, int64_t row, __m512 v) {
  if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + 16 * t));
  const int64_t o = row * a.out_stride() + 16 * t;
  if (a.out_f32)
    _mm512_storeu_ps(a.out_f32 + o, v);
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.out_bf16 + o), (__m256i)_mm512_cvtneps_pbh(v));
}

constexpr int64_t kRowChunk = 96;  // rows of x per pass over a tile: y stays in L1

template <int P, int BITS, bool LOW, bool F16>
void run(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / a.group, per = LOW ? 32 : 16;
  const int64_t tile = tile_bytes(BITS, 2 * P);
  const __m512i table = BITS == 5 ? signed5_table() : nibble_table();
  static const float zero = 0.f;
  alignas(64) float y[kRowChunk * 16];
  alignas(64) __m512i wbuf[16];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, a.M - m0);
      std::memset(y, 0, sizeof(float) * 16 * mc);
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* base = a.q + (t * G + g) * tile;
        const int64_t at = (t * G + g) * per;
        const __m512 s = load16<F16>(a.scales, at);
        const __m512 l = LOW ? load16<F16>(a.scales, at + 16) : _mm512_setzero_ps();
        const float* xs = LOW ? a.xsum + m0 * G + g : &zero;
        rows<P, BITS, LOW>(mc, base, wbuf, table, s, l, a.xb + m0 * K + g * a.group, K, xs,
                           LOW ? G : 0, y);
      }
      for (int64_t r = 0; r < mc; ++r) store_row(a, t, m0 + r, _mm512_load_ps(y + 16 * r));
    }
  }
}

// AMX path (Intel Sapphire Rapids and later): one `tdpbf16ps` multiplies 16 rows of x by a
// whole unpacked weight tile (one group of k x 16 columns). The unpacked tile, pair after pair,
// is already the instruction's B operand (rows of k pairs, each holding 16 columns x 2 k), so
// only the scaling per group stays on the vector unit. The products are the same exact bfloat16
// products as above, summed in float32 per group.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// acc [NR rows] += scale * c + low * xsum: one group's products c [NR rows x 16 columns]
template <int NR, bool LOW, bool F16>
CLOVER_INLINE void amx_scale(const QGemm& a, const float* c, int64_t at, const float* xs,
                             int64_t G, __m512* acc) {
  const __m512 s = load16<F16>(a.scales, at);
  const __m512 l = LOW ? load16<F16>(a.scales, at + 16) : _mm512_setzero_ps();
  for (int r = 0; r < NR; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), s, acc[r]);
    if (LOW) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G]), l, acc[r]);
  }
}

template <int P, int BITS>
CLOVER_INLINE void unpack_group(const uint8_t* base, __m512i table, __m512i* w) {
  for (int p = 0; p < P; ++p) _mm512_store_si512(w + p, unpack_pair<BITS>(base, p, table));
}

// groups ahead to prefetch while a tile is unpacked (a model that streams from DRAM)
constexpr int64_t kAhead = 8;

// passes of fewer rows than this stay on `vdpbf16ps`, and so do the last rows of a pass when
// fewer than this are left after its blocks of 16 (an AMX block costs about as much as 3 rows
// on `vdpbf16ps`)
constexpr int64_t kAmxMinRows = 3;

// NR: rows of x per tile, 16 or (passes of up to 4 rows: a verify pass) 4
template <int P, int BITS, bool LOW, bool F16, int NR>
__attribute__((target("amx-tile,amx-bf16"))) void run_amx(const QGemm& a, int64_t t0,
                                                          int64_t t1) {
  const int64_t K = a.K, G = K / a.group, per = LOW ? 32 : 16, M = a.M;
  const int64_t tile = tile_bytes(BITS, 2 * P);
  const __m512i table = BITS == 5 ? signed5_table() : nibble_table();
  // tiles read NR rows of x (and of its group sums): the rows after the last multiple of NR
  // are copied once, padded with zeros
  const int64_t full = M / NR * NR;
  std::vector<uint16_t> pad(M > full ? NR * K : 0, 0);
  std::vector<float> pad_xs(M > full && LOW ? NR * G : 0, 0.f);
  if (M > full) {
    std::memcpy(pad.data(), a.xb + full * K, sizeof(uint16_t) * (M - full) * K);
    if (LOW) std::memcpy(pad_xs.data(), a.xsum + full * G, sizeof(float) * (M - full) * G);
  }
  // a weight tile's groups, unpacked once for every row of x by the first block of rows, two
  // groups ahead of the tile loads that read them (a tile load does not take data from stores
  // still in flight)
  std::vector<__m512i> w(G * P);
  TileConfig cfg;
  for (int i : {0, 1}) {
    cfg.rows[i] = NR, cfg.colsb[i] = 64;          // C: NR rows of x x 16 columns, float32
    cfg.rows[2 + i] = NR, cfg.colsb[2 + i] = 4 * P;  // A: NR rows of x x one group, bfloat16
    cfg.rows[4 + i] = P, cfg.colsb[4 + i] = 64;   // B: one group of the weight tile
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[2][NR * 16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* base = a.q + t * G * tile;
    const int64_t at = t * G * per;
    for (int64_t m = 0; m < M; m += NR) {
      if (m > 0 && M - m < kAmxMinRows) {  // a row or two left: on the unpacked groups
        static const float zero = 0.f;
        alignas(64) float y[16 * kAmxMinRows] = {};
        for (int64_t g = 0; g < G; ++g) {
          const __m512 s = load16<F16>(a.scales, at + g * per);
          const __m512 l = LOW ? load16<F16>(a.scales, at + g * per + 16) : _mm512_setzero_ps();
          const uint16_t* x = a.xb + m * K + g * a.group;
          const float* xs = LOW ? a.xsum + m * G + g : &zero;
          if (M - m == 1)
            micro<1, 4, P, BITS, LOW>(nullptr, &w[g * P], table, s, l, x, K, xs, LOW ? G : 0, y);
          else
            micro<2, 2, P, BITS, LOW>(nullptr, &w[g * P], table, s, l, x, K, xs, LOW ? G : 0, y);
        }
        for (int64_t r = 0; r < M - m; ++r) store_row(a, t, m + r, _mm512_load_ps(y + 16 * r));
        break;
      }
      const bool first = m == 0, padded = m + NR > M;
      const uint16_t* xa = padded ? pad.data() : a.xb + m * K;
      const float* xs = !LOW ? nullptr : padded ? pad_xs.data() : a.xsum + m * G;
      if (first)
        for (int64_t g = 0; g < std::min<int64_t>(2, G); ++g)
          unpack_group<P, BITS>(base + g * tile, table, &w[g * P]);
      __m512 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) {  // two groups in flight
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, xa + g * a.group, 2 * K);
        _tile_loadd(4, &w[g * P], 64);
        _tile_loadd(3, xa + (g + 1) * a.group, 2 * K);
        _tile_loadd(5, &w[(g + 1) * P], 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 5);
        if (first)
          for (int64_t u = g + 2; u < std::min(g + 4, G); ++u) {
            unpack_group<P, BITS>(base + u * tile, table, &w[u * P]);
            for (int64_t at = (u + kAhead) * tile; at < (u + kAhead + 1) * tile; at += 64)
              _mm_prefetch(reinterpret_cast<const char*>(base + at), _MM_HINT_T0);  // no fault
          }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        amx_scale<NR, LOW, F16>(a, c[0], at + g * per, LOW ? xs + g : nullptr, G, acc);
        amx_scale<NR, LOW, F16>(a, c[1], at + (g + 1) * per, LOW ? xs + g + 1 : nullptr, G, acc);
      }
      if (g < G) {
        _tile_zero(0);
        _tile_loadd(2, xa + g * a.group, 2 * K);
        _tile_loadd(4, &w[g * P], 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_stored(0, c[0], 64);
        amx_scale<NR, LOW, F16>(a, c[0], at + g * per, LOW ? xs + g : nullptr, G, acc);
      }
      for (int64_t r = 0; r < std::min<int64_t>(NR, M - m); ++r) store_row(a, t, m + r, acc[r]);
    }
  }
  _tile_release();
}

}  // namespace

void qgemm_tiles_avx512(const QGemm& a, int64_t t0, int64_t t1) {
  dispatch_format(a, [&](auto P, auto BITS, auto LOW, auto F16) {
    run<decltype(P)::value, decltype(BITS)::value, decltype(LOW)::value, decltype(F16)::value>(
        a, t0, t1);
  });
}

void qgemm_tiles_amx(const QGemm& a, int64_t t0, int64_t t1) {
  if (a.M < kAmxMinRows) return qgemm_tiles_avx512(a, t0, t1);
  dispatch_format(a, [&](auto P, auto BITS, auto LOW, auto F16) {
    constexpr int p = decltype(P)::value, bits = decltype(BITS)::value;
    constexpr bool low = decltype(LOW)::value, f16 = decltype(F16)::value;
    if (a.M <= 4)  // a verify pass: tiles of 4 rows
      run_amx<p, bits, low, f16, 4>(a, t0, t1);
    else
      run_amx<p, bits, low, f16, 16>(a, t0, t1);
  });
}

}  // namespace clover

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else  // not x86-64: never selected (the dispatcher checks the CPU)
#include "qgemm.h"
namespace clover {
void qgemm_tiles_avx512(const QGemm& a, int64_t t0, int64_t t1) { qgemm_tiles_scalar(a, t0, t1); }
void qgemm_tiles_amx(const QGemm& a, int64_t t0, int64_t t1) { qgemm_tiles_scalar(a, t0, t1); }
}  // namespace clover
#endif
