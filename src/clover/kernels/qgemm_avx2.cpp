// AVX2 + FMA path of the quantized matmul, for x86 CPUs without AVX-512 BF16. No bfloat16
// dot instruction here: levels are widened to float32 and multiplied with FMA. Lanes hold
// (row, k parity) pairs, so the packed layout of qgemm.h is read as it is; the two parities
// of a row are added once at the end. Unpacking the levels costs more instructions than the
// FMAs that use them, so a pass of 2 rows or more unpacks each group of a tile once into L1
// and every row reads it from there (unpacking it for every two rows would make a pass of 8
// rows cost several times one row).
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
#include <vector>

#include "qgemm.h"

#define CLOVER_INLINE inline __attribute__((always_inline))

namespace clover {
namespace {

// pair p of a tile -> w[h]: rows 4h..4h+3 x (k even, k odd) as float32
template <int BITS>
CLOVER_INLINE void unpack_pair(const uint8_t* base, int p, __m256* w) {
  uint32_t high = 0, top = 0;  // int5, int6: bit w = bit 4 (top: 5) of word w's level + bias
  if (BITS == 5) std::memcpy(&high, base + mask_offset(32, 0) + 4 * p, 4);
  if (BITS == 6) {
    std::memcpy(&high, base + mask_offset(16, 0) + 4 * p, 4);
    std::memcpy(&top, base + mask_offset(16, 1) + 4 * p, 4);
  }
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int h = 0; h < 4; ++h) {
    __m256i d;
    if (BITS != 8) {
      const uint8_t* words = base + 64 * (p / 4) + 16 * h;
      d = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words)));
      d = _mm256_srl_epi32(d, _mm_cvtsi32_si128(4 * (p % 4)));
      d = _mm256_and_si256(d, _mm256_set1_epi32(15));
      const auto add = [&](uint32_t mask, int value) {  // + value where word's bit is set
        const __m256i m = _mm256_set1_epi32(static_cast<int>((mask >> (8 * h)) & 0xff));
        const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(m, bit), bit);
        d = _mm256_add_epi32(d, _mm256_and_si256(set, _mm256_set1_epi32(value)));
      };
      if (BITS == 5) {  // levels -16..15
        add(high, 16);
        d = _mm256_sub_epi32(d, _mm256_set1_epi32(16));
      }
      if (BITS == 6) {  // levels -32..31
        add(high, 16);
        add(top, 32);
        d = _mm256_sub_epi32(d, _mm256_set1_epi32(32));
      }
    } else {
      d = _mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + 32 * p + 8 * h)));
    }
    w[h] = _mm256_cvtepi32_ps(d);
  }
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

// [x0, x1] x 4 from two float32 values in memory: one broadcast load
CLOVER_INLINE __m256 pair_f32(const float* x) {
  return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x)));
}

// 8 bfloat16 values -> float32 at `out` (32-byte aligned): shift into the high half
CLOVER_INLINE void bf16x8_to_f32(const uint16_t* x, float* out) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  _mm256_store_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
}

// output (m, n) = v + bias, as float32 or bfloat16
CLOVER_INLINE void put(const QGemm& a, int64_t m, int64_t n, float v) {
  if (a.bias) v += a.bias[n];
  if (a.out_f32)
    a.out_f32[m * a.out_stride() + n] = v;
  else
    a.out_bf16[m * a.out_stride() + n] = to_bf16(v);
}

// y (row, parity lanes) += scale * acc (+ low * sum of the group's x) for one row
template <bool LOW>
CLOVER_INLINE void add_group(float* yr, const __m256* acc, const __m256* s, const __m256* l,
                             float xsum) {
  const __m256 xs = _mm256_set1_ps(xsum);
  for (int h = 0; h < 4; ++h) {
    __m256 v = _mm256_fmadd_ps(acc[h], s[h], _mm256_loadu_ps(yr + 8 * h));
    if (LOW) v = _mm256_fmadd_ps(xs, l[h], v);
    _mm256_storeu_ps(yr + 8 * h, v);
  }
}

template <int P, int BITS, bool LOW, bool F16>
void run(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / a.group, per = LOW ? 32 : 16;
  const int64_t tile = tile_bytes(BITS, 2 * P);
  alignas(32) float y[kRowChunk * 32];  // (row, parity) lanes
  alignas(32) float xf[kRowChunk * 2 * P];  // the group's x of the chunk's rows, float32
  __m256 wb[P][4];  // one group of a tile unpacked, for passes of 2 rows or more
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
        for (int64_t r = 0; r < mc; ++r) {
          const uint16_t* x = a.xb + (m0 + r) * K + g * a.group;
          for (int64_t i = 0; i < 2 * P; i += 8) bf16x8_to_f32(x + i, xf + r * 2 * P + i);
        }
        const float* xsum = LOW ? a.xsum + m0 * G + g : nullptr;
        if (mc == 1) {  // decode: unpack into registers, used by the one row
          __m256 acc[4], w[4];
          for (int h = 0; h < 4; ++h) acc[h] = _mm256_setzero_ps();
          if (BITS == 4) {  // a chunk's words widened once for its 4 pairs (nibble j: pair 4c + j)
            const __m256i low4 = _mm256_set1_epi32(15);
            for (int c = 0; c < P / 4; ++c) {
              __m256i d[4];
              for (int h = 0; h < 4; ++h)
                d[h] = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 64 * c + 16 * h)));
              for (int j = 0; j < 4; ++j) {
                const __m256 bx = pair_f32(xf + 2 * (4 * c + j));
                for (int h = 0; h < 4; ++h) {
                  const __m256 wv = _mm256_cvtepi32_ps(_mm256_and_si256(d[h], low4));
                  d[h] = _mm256_srli_epi32(d[h], 4);
                  acc[h] = _mm256_fmadd_ps(wv, bx, acc[h]);
                }
              }
            }
          } else {
            for (int p = 0; p < P; ++p) {
              unpack_pair<BITS>(base, p, w);
              const __m256 bx = pair_f32(xf + 2 * p);
              for (int h = 0; h < 4; ++h) acc[h] = _mm256_fmadd_ps(w[h], bx, acc[h]);
            }
          }
          add_group<LOW>(y, acc, s, l, LOW ? xsum[0] : 0.f);
          continue;
        }
        // two rows or more (through registers, two rows would cost 2x one): unpack the group
        // once, then two rows at a time read it from L1 (three at a time, or a branch for a
        // last odd row, are slower)
        if (BITS == 4) {  // as above: each chunk's words widened once for its 4 pairs
          for (int c = 0; c < P / 4; ++c)
            for (int h = 0; h < 4; ++h) {
              __m256i d = _mm256_cvtepu16_epi32(
                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 64 * c + 16 * h)));
              for (int j = 0; j < 4; ++j, d = _mm256_srli_epi32(d, 4))
                wb[4 * c + j][h] = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
            }
        } else {
          for (int p = 0; p < P; ++p) unpack_pair<BITS>(base, p, wb[p]);
        }
        for (int64_t r0 = 0; r0 < mc; r0 += 2) {
          const int mb = mc - r0 >= 2 ? 2 : 1;
          const float* x0 = xf + r0 * 2 * P;
          const float* x1 = mb == 2 ? x0 + 2 * P : x0;  // a last odd row: twice, kept once
          __m256 acc[2][4];
          for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 4; ++h) acc[r][h] = _mm256_setzero_ps();
          for (int p = 0; p < P; ++p) {
            const __m256 b0 = pair_f32(x0 + 2 * p), b1 = pair_f32(x1 + 2 * p);
            for (int h = 0; h < 4; ++h) {
              acc[0][h] = _mm256_fmadd_ps(wb[p][h], b0, acc[0][h]);
              acc[1][h] = _mm256_fmadd_ps(wb[p][h], b1, acc[1][h]);
            }
          }
          for (int r = 0; r < mb; ++r)
            add_group<LOW>(y + 32 * (r0 + r), acc[r], s, l, LOW ? xsum[(r0 + r) * G] : 0.f);
        }
      }
      for (int64_t r = 0; r < mc; ++r)
        for (int64_t i = 0; i < 16; ++i)
          put(a, m0 + r, 16 * t + i, y[32 * r + 2 * i] + y[32 * r + 2 * i + 1]);
    }
  }
}

// --- wide passes (a prompt, a training batch): whole weights, a register-blocked kernel ---
//
// The path above keeps a tile's levels in (row, parity) lanes and adds every group's sum into
// memory, which makes a wide pass slower than the float32 matmul of the same weights. Here each tile's levels become float32 weights (scale * level + low) in a panel of
// kKc k x 16 columns, and blocks of up to 6 rows multiply it with the accumulators in
// registers (2 vectors of 8 columns per row), the classic small-GEMM kernel. Every row runs the
// same sequence of FMAs (k in order, blocks of kKc in order) whatever the pass width and its
// place in a block, so a row's result does not depend on the rows beside it.

constexpr int64_t kMc = 96, kKc = 256;

// rows 4h..4h+3 x (k even, k odd) lanes (as unpack_pair writes them), times scale plus low ->
// panel rows k0 (even) and k0 + 1 (odd), 16 columns each
CLOVER_INLINE void to_panel(const __m256* w, float* even) {
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 v[4];  // [rows 4h..4h+3 at k even | the same rows at k odd]
  for (int h = 0; h < 4; ++h) v[h] = _mm256_permutevar8x32_ps(w[h], split);
  _mm256_storeu_ps(even, _mm256_permute2f128_ps(v[0], v[1], 0x20));
  _mm256_storeu_ps(even + 8, _mm256_permute2f128_ps(v[2], v[3], 0x20));
  _mm256_storeu_ps(even + 16, _mm256_permute2f128_ps(v[0], v[1], 0x31));
  _mm256_storeu_ps(even + 24, _mm256_permute2f128_ps(v[2], v[3], 0x31));
}

// y[r] (16 floats) += sum over k < kc of panel[k] * x[r][k], rows r < R. Not inlined: 6 rows
// take 12 accumulators + 2 weights + 1 broadcast of the 16 registers, and inlined into the
// int5 kernel it would lose some of them to the unpacking's constants
template <int R>
__attribute__((noinline)) void block_rows(const float* panel, int64_t kc, const float* x,
                                          float* y) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    acc[r][0] = _mm256_loadu_ps(y + 16 * r), acc[r][1] = _mm256_loadu_ps(y + 16 * r + 8);
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + 16 * k), w1 = _mm256_load_ps(panel + 16 * k + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * kKc + k);
      acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(y + 16 * r, acc[r][0]), _mm256_storeu_ps(y + 16 * r + 8, acc[r][1]);
}

template <int P, int BITS, bool LOW, bool F16>
void run_wide(const QGemm& a, int64_t t0, int64_t t1) {
  const int64_t K = a.K, G = K / a.group, per = LOW ? 32 : 16;
  const int64_t tile = tile_bytes(BITS, 2 * P);
  alignas(32) static thread_local float xf[kMc * kKc];  // the block's x, float32
  alignas(32) static thread_local float panel[kKc * 16];
  std::vector<float> y((t1 - t0) * kMc * 16);
  for (int64_t m0 = 0; m0 < a.M; m0 += kMc) {
    const int64_t mc = std::min(kMc, a.M - m0);
    std::fill(y.begin(), y.end(), 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);  // a multiple of the group: of 8
      for (int64_t r = 0; r < mc; ++r) {
        const uint16_t* x = a.xb + (m0 + r) * K + k0;
        for (int64_t i = 0; i < kc; i += 8) bf16x8_to_f32(x + i, xf + r * kKc + i);
      }
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t g = k0 / a.group; g < (k0 + kc) / a.group; ++g) {
          const uint8_t* base = a.q + (t * G + g) * tile;
          const int64_t at = (t * G + g) * per;
          __m256 s[4], l[4], w[4];
          load_dup<F16>(a.scales, at, false, s);
          if (LOW) load_dup<F16>(a.scales, at + 16, false, l);
          float* out = panel + (g * a.group - k0) * 16;
          for (int p = 0; p < P; ++p) {
            unpack_pair<BITS>(base, p, w);
            for (int h = 0; h < 4; ++h)
              w[h] = LOW ? _mm256_fmadd_ps(w[h], s[h], l[h]) : _mm256_mul_ps(w[h], s[h]);
            to_panel(w, out + 32 * p);
          }
        }
        float* yt = y.data() + (t - t0) * kMc * 16;
        int64_t r0 = 0;
        for (; r0 + 6 <= mc; r0 += 6) block_rows<6>(panel, kc, xf + r0 * kKc, yt + 16 * r0);
        const float* xr = xf + r0 * kKc;
        float* yr = yt + 16 * r0;
        switch (mc - r0) {
          case 5: block_rows<5>(panel, kc, xr, yr); break;
          case 4: block_rows<4>(panel, kc, xr, yr); break;
          case 3: block_rows<3>(panel, kc, xr, yr); break;
          case 2: block_rows<2>(panel, kc, xr, yr); break;
          case 1: block_rows<1>(panel, kc, xr, yr); break;
          default: break;
        }
      }
    }
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < mc; ++r)
        for (int64_t i = 0; i < 16; ++i)
          put(a, m0 + r, 16 * t + i, y[((t - t0) * kMc + r) * 16 + i]);
  }
}

}  // namespace

void qgemm_tiles_wide_avx2(const QGemm& a, int64_t t0, int64_t t1) {
  dispatch_format(a, [&](auto P, auto BITS, auto LOW, auto F16) {
    run_wide<decltype(P)::value, decltype(BITS)::value, decltype(LOW)::value,
             decltype(F16)::value>(a, t0, t1);
  });
}

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
void qgemm_tiles_wide_avx2(const QGemm& a, int64_t t0, int64_t t1) {
  qgemm_tiles_scalar(a, t0, t1);
}
}  // namespace clover
#endif
