// Attention of one query over keys [0, end) of one head of the KV cache, float32:
// out [Dh] = softmax(q . K^T * scale) V, K and V [capacity, Dh] row-major as the cache holds
// them. Three paths: portable loops (any CPU); AVX-512 for Dh a multiple of 16, which takes
// the dots of 16 keys at once (16 accumulators, then a transposing reduction tree) instead of
// reducing every key's vector separately: ~6 instructions a key instead of ~20; and AVX2 + FMA
// for Dh a multiple of 8, the same with 8 keys (the portable loop's float sums do not
// vectorize, which leaves it far above its memory bound).
#include "attention.h"

#include "qgemm.h"  // to_bf16

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace clover {

// keys [base, end) that a tree's query does not see (sees[key - base] == 0) score -inf
static inline void hide_keys(float* scores, int64_t end, const uint8_t* sees, int64_t base) {
  if (sees == nullptr) return;
  for (int64_t s = std::max<int64_t>(base, 0); s < end; ++s)
    if (!sees[s - base]) scores[s] = -INFINITY;
}

static void attend_portable(const float* q, const float* K, const float* V, int64_t end,
                            int64_t Dh, float scale, float* scores, float* out,
                            const uint8_t* sees = nullptr, int64_t base = 0) {
  for (int64_t s = 0; s < end; ++s) {
    float acc = 0.f;
    for (int64_t d = 0; d < Dh; ++d) acc += q[d] * K[s * Dh + d];
    scores[s] = acc * scale;
  }
  hide_keys(scores, end, sees, base);
  float top = -INFINITY;
  for (int64_t s = 0; s < end; ++s) top = std::max(top, scores[s]);
  float total = 0.f;
  for (int64_t s = 0; s < end; ++s) {
    scores[s] = scores[s] == -INFINITY ? 0.f : exp_approx(scores[s] - top);
    total += scores[s];
  }
  std::fill(out, out + Dh, 0.f);
  for (int64_t s = 0; s < end; ++s) {
    const float p = scores[s] / total;
    for (int64_t d = 0; d < Dh; ++d) out[d] += p * V[s * Dh + d];
  }
}

// gates gu[0, n) with their ups `up_at` further on (F: the row's own tail calls it with n < F)
static void silu_mul_portable(const float* gu, int64_t n, uint16_t* out, int64_t up_at) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gu[i];
    out[i] = to_bf16(g / (1.0f + exp_approx(std::min(-g, 88.0f))) * gu[up_at + i]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define AVX512 __attribute__((target("avx512f,avx512dq"), always_inline)) inline

AVX512 __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

AVX512 __m512 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // each 128-bit lane L of the result: [part of a0, part of a1, part of a2, part of a3], where
  // the parts over the 4 lanes add up to the totals
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xee));
}

// 16 vectors -> [sum(a[0]), ..., sum(a[15])]
AVX512 __m512 reduce16(const __m512* a) {
  const __m512 s0 = reduce4(a[0], a[1], a[2], a[3]), s1 = reduce4(a[4], a[5], a[6], a[7]);
  const __m512 s2 = reduce4(a[8], a[9], a[10], a[11]), s3 = reduce4(a[12], a[13], a[14], a[15]);
  // lane j of si holds keys 4i..4i+3 (partial); fold the 4 lanes of each into one
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xdd));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(s2, s3, 0x88), _mm512_shuffle_f32x4(s2, s3, 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}

__attribute__((target("avx512f,avx512dq"))) static void attend_avx512(
    const float* q, const float* K, const float* V, int64_t end, int64_t Dh, float scale,
    float* scores, float* out) {
  const int64_t C = Dh / 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t s = 0;
  for (; s + 16 <= end; s += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + 16 * c);
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(K + (s + i) * Dh + 16 * c), acc[i]);
    }
    const __m512 v = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
    _mm512_storeu_ps(scores + s, v);
    top = _mm512_max_ps(top, v);
  }
  float m = _mm512_reduce_max_ps(top);
  for (; s < end; ++s) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(K + s * Dh + 16 * c), acc);
    scores[s] = _mm512_reduce_add_ps(acc) * scale;
    m = std::max(m, scores[s]);
  }
  __m512 total = _mm512_setzero_ps();
  for (s = 0; s < end; s += 16) {
    const __mmask16 k = end - s >= 16 ? 0xffff : static_cast<__mmask16>((1u << (end - s)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + s), _mm512_set1_ps(m)));
    const __m512 em = _mm512_maskz_mov_ps(k, e);
    _mm512_mask_storeu_ps(scores + s, k, em);
    total = _mm512_add_ps(total, em);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(total);
  // out = sum_t p_t V[t]: 4 chunks of out at a time, two chains each (even and odd keys), so
  // 8 independent FMA chains hide the latency
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    const int cs = static_cast<int>(std::min<int64_t>(4, C - c0));
    __m512 o[2][4];
    for (int j = 0; j < 4; ++j) o[0][j] = o[1][j] = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 2 <= end; t += 2) {
      const __m512 p0 = _mm512_set1_ps(scores[t]), p1 = _mm512_set1_ps(scores[t + 1]);
      const float* v = V + t * Dh + 16 * c0;
      for (int j = 0; j < cs; ++j) {
        o[0][j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + 16 * j), o[0][j]);
        o[1][j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v + Dh + 16 * j), o[1][j]);
      }
    }
    if (t < end) {
      const __m512 p0 = _mm512_set1_ps(scores[t]);
      for (int j = 0; j < cs; ++j)
        o[0][j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(V + t * Dh + 16 * (c0 + j)), o[0][j]);
    }
    for (int j = 0; j < cs; ++j)
      _mm512_storeu_ps(out + 16 * (c0 + j),
                       _mm512_mul_ps(_mm512_add_ps(o[0][j], o[1][j]), _mm512_set1_ps(inv)));
  }
}

// Up to 4 queries of one head at once (tokens of one pass): each key and value row is loaded
// once for all of them instead of once per query, which is what bounds the one-query loop.
// Query i sees keys [0, ends[i]); scores: scratch of 4 x `stride` (>= max end) floats.
template <int NQ>
__attribute__((target("avx512f,avx512dq"))) static void attend_multi_avx512(
    const float* const* q, const int64_t* ends, const float* K, const float* V, int64_t Dh,
    float scale, float* scores, int64_t stride, float* const* out, const uint8_t* const* sees,
    const int64_t* base) {
  const int64_t C = Dh / 16;
  int64_t E = 0;
  for (int i = 0; i < NQ; ++i) E = std::max(E, ends[i]);
  // scores, 4 keys at a time: NQ x 4 accumulators over the head's chunks
  for (int64_t s = 0; s < E; s += 4) {
    __m512 acc[NQ][4];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    const float* rows[4];
    for (int j = 0; j < 4; ++j) rows[j] = K + std::min(s + j, E - 1) * Dh;  // stay in the cache
    for (int64_t c = 0; c < C; ++c) {
      __m512 k[4];
      for (int j = 0; j < 4; ++j) k[j] = _mm512_loadu_ps(rows[j] + 16 * c);
      for (int i = 0; i < NQ; ++i) {
        const __m512 qc = _mm512_loadu_ps(q[i] + 16 * c);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(qc, k[j], acc[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      const __m512 r = reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      const __m128 t = _mm_add_ps(
          _mm_add_ps(_mm512_castps512_ps128(r), _mm512_extractf32x4_ps(r, 1)),
          _mm_add_ps(_mm512_extractf32x4_ps(r, 2), _mm512_extractf32x4_ps(r, 3)));
      alignas(16) float v[4];
      _mm_store_ps(v, _mm_mul_ps(t, _mm_set1_ps(scale)));
      for (int j = 0; j < 4 && s + j < E; ++j)
        scores[i * stride + s + j] = s + j < ends[i] ? v[j] : -INFINITY;
    }
  }
  if (sees != nullptr)
    for (int i = 0; i < NQ; ++i) hide_keys(scores + i * stride, ends[i], sees[i], base[i]);
  // softmax per query; the keys a query does not see (past its end, or -inf) weigh 0
  float inv[NQ];
  for (int i = 0; i < NQ; ++i) {
    float* sc = scores + i * stride;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < E; s += 16) {
      const __mmask16 k = E - s >= 16 ? 0xffff : static_cast<__mmask16>((1u << (E - s)) - 1);
      top = _mm512_mask_max_ps(top, k, top, _mm512_maskz_loadu_ps(k, sc + s));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t s = 0; s < E; s += 16) {
      const __mmask16 k = E - s >= 16 ? 0xffff : static_cast<__mmask16>((1u << (E - s)) - 1);
      const __mmask16 seen = k & (ends[i] - s >= 16 ? 0xffff
                                  : ends[i] > s ? static_cast<__mmask16>((1u << (ends[i] - s)) - 1)
                                               : 0);
      const __m512 x = _mm512_maskz_loadu_ps(k, sc + s);
      const __mmask16 shown =
          seen & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(shown, exp512(_mm512_sub_ps(x, m)));
      _mm512_mask_storeu_ps(sc + s, k, e);
      total = _mm512_add_ps(total, e);
    }
    inv[i] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // out = sum_t p_t V[t], every value row loaded once for the NQ queries: chunks of the head
  // in groups that keep NQ x cs accumulators in registers
  constexpr int CS = 16 / NQ;
  for (int64_t c0 = 0; c0 < C; c0 += CS) {
    const int cs = static_cast<int>(std::min<int64_t>(CS, C - c0));
    __m512 o[NQ][CS];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < CS; ++j) o[i][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < E; ++t) {
      const float* v = V + t * Dh + 16 * c0;
      for (int j = 0; j < cs; ++j) {
        const __m512 vj = _mm512_loadu_ps(v + 16 * j);
        for (int i = 0; i < NQ; ++i)
          o[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[i * stride + t]), vj, o[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < cs; ++j)
        _mm512_storeu_ps(out[i] + 16 * (c0 + j), _mm512_mul_ps(o[i][j], _mm512_set1_ps(inv[i])));
  }
}

// --- AVX2 + FMA (x86 CPUs without AVX-512): 8 lanes, tails through lane masks -------------

#define AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

AVX2 __m256 exp256(__m256 x) {  // exp_approx, 8 lanes
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// 8 vectors -> [sum(a[0]), ..., sum(a[7])]
AVX2 __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0: [a0..a3 each summed over its low half | over its high half] (h1: a4..a7); fold
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

AVX2 float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2 float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

AVX2 __m256i lanes_below(int64_t n) {  // lane j set where j < n
  const int c = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, 8)));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// NQ (1-4) queries of one head, query i over keys [0, ends[i]); Dh a multiple of 8. Each
// block of 8 keys is loaded from memory once and reused from L1 by every query; each value
// row once for all queries. scores: NQ x `stride` floats.
template <int NQ>
__attribute__((target("avx2,fma"))) static void attend_avx2(
    const float* const* q, const int64_t* ends, const float* K, const float* V, int64_t Dh,
    float scale, float* scores, int64_t stride, float* const* out,
    const uint8_t* const* sees = nullptr, const int64_t* base = nullptr) {
  const int64_t C = Dh / 8;
  int64_t E = 0;
  for (int i = 0; i < NQ; ++i) E = std::max(E, ends[i]);
  const __m256 none = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s < E; s += 8) {
    const float* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = K + std::min(s + j, E - 1) * Dh;  // stay in the cache
    const __m256i stored = lanes_below(E - s);
    for (int i = 0; i < NQ; ++i) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(q[i] + 8 * c);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + 8 * c), acc[j]);
      }
      __m256 v = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));
      v = _mm256_blendv_ps(none, v, _mm256_castsi256_ps(lanes_below(ends[i] - s)));
      _mm256_maskstore_ps(scores + i * stride + s, stored, v);
    }
  }
  if (sees != nullptr)
    for (int i = 0; i < NQ; ++i) hide_keys(scores + i * stride, ends[i], sees[i], base[i]);
  float inv[NQ];
  for (int i = 0; i < NQ; ++i) {  // softmax; the keys a query does not see weigh 0
    float* sc = scores + i * stride;
    __m256 top = none;
    for (int64_t s = 0; s < E; s += 8) {
      const __m256i m = lanes_below(E - s);
      top = _mm256_max_ps(top, _mm256_blendv_ps(none, _mm256_maskload_ps(sc + s, m),
                                                _mm256_castsi256_ps(m)));
    }
    const __m256 mx = _mm256_set1_ps(hmax8(top));
    __m256 total = _mm256_setzero_ps();
    for (int64_t s = 0; s < E; s += 8) {
      const __m256i m = lanes_below(E - s);
      const __m256 x = _mm256_maskload_ps(sc + s, m);
      const __m256 seen = _mm256_and_ps(_mm256_castsi256_ps(lanes_below(ends[i] - s)),
                                        _mm256_cmp_ps(x, none, _CMP_NEQ_OQ));
      const __m256 e = _mm256_and_ps(seen, exp256(_mm256_sub_ps(x, mx)));
      _mm256_maskstore_ps(sc + s, m, e);
      total = _mm256_add_ps(total, e);
    }
    inv[i] = 1.0f / hsum8(total);
  }
  // out = sum_t p_t V[t]: NQ x CS accumulators in registers (8 independent chains or more)
  constexpr int CS = NQ == 1 ? 8 : NQ == 2 ? 4 : NQ == 3 ? 3 : 2;
  for (int64_t c0 = 0; c0 < C; c0 += CS) {
    const int cs = static_cast<int>(std::min<int64_t>(CS, C - c0));
    __m256 o[NQ][CS];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < CS; ++j) o[i][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < E; ++t) {
      const float* v = V + t * Dh + 8 * c0;
      __m256 p[NQ];
      for (int i = 0; i < NQ; ++i) p[i] = _mm256_set1_ps(scores[i * stride + t]);
      for (int j = 0; j < cs; ++j) {
        const __m256 vj = _mm256_loadu_ps(v + 8 * j);
        for (int i = 0; i < NQ; ++i) o[i][j] = _mm256_fmadd_ps(p[i], vj, o[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < cs; ++j)
        _mm256_storeu_ps(out[i] + 8 * (c0 + j), _mm256_mul_ps(o[i][j], _mm256_set1_ps(inv[i])));
  }
}

// to_bf16 of 8 lanes: round to nearest even on the bits, NaN -> 0x7fc0
AVX2 __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // <= 0xffff
}

// silu_mul_portable on 8 lanes: the same operations in the same order, exp256 for exp_approx
// (its fused multiply-adds may move the last bit of a float, then rarely a bfloat16's)
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float* gu, int64_t F,
                                                              uint16_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f),
               cap = _mm256_set1_ps(88.0f);
  int64_t i = 0;
  for (; i + 8 <= F; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i);
    // min(88, -g): a NaN gate stays NaN (the second operand), as std::min(-g, 88) keeps it
    const __m256 e = exp256(_mm256_min_ps(cap, _mm256_xor_ps(g, sign)));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    const __m256 y = _mm256_mul_ps(s, _mm256_loadu_ps(gu + F + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16x8(y));
  }
  if (i < F) silu_mul_portable(gu + i, F - i, out + i, F);
}
#endif

void attend_query(const float* q, const float* K, const float* V, int64_t end, int64_t Dh,
                  float scale, float* scores, float* out, int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= 2 && Dh % 16 == 0) return attend_avx512(q, K, V, end, Dh, scale, scores, out);
  if (isa >= 1 && Dh % 8 == 0) return attend_avx2<1>(&q, &end, K, V, Dh, scale, scores, 0, &out);
#endif
  attend_portable(q, K, V, end, Dh, scale, scores, out);
}

void silu_mul(const float* gu, int64_t F, uint16_t* out, int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= 1) return silu_mul_avx2(gu, F, out);
#endif
  silu_mul_portable(gu, F, out, F);
}

}  // namespace clover

namespace clover {

void attend_queries(const float* const* q, const int64_t* ends, int n, const float* K,
                    const float* V, int64_t Dh, float scale, float* scores, int64_t stride,
                    float* const* out, int isa, const uint8_t* const* sees,
                    const int64_t* base) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= 2 && Dh % 16 == 0) {
    const uint8_t* const* v = sees;
    switch (n) {
      case 4: return attend_multi_avx512<4>(q, ends, K, V, Dh, scale, scores, stride, out, v, base);
      case 3: return attend_multi_avx512<3>(q, ends, K, V, Dh, scale, scores, stride, out, v, base);
      case 2: return attend_multi_avx512<2>(q, ends, K, V, Dh, scale, scores, stride, out, v, base);
      case 1:  // the one-query loop knows no tree
        if (sees != nullptr)
          return attend_multi_avx512<1>(q, ends, K, V, Dh, scale, scores, stride, out, v, base);
        break;
      default: break;
    }
  } else if (isa >= 1 && Dh % 8 == 0) {
    switch (n) {
      case 4: return attend_avx2<4>(q, ends, K, V, Dh, scale, scores, stride, out, sees, base);
      case 3: return attend_avx2<3>(q, ends, K, V, Dh, scale, scores, stride, out, sees, base);
      case 2: return attend_avx2<2>(q, ends, K, V, Dh, scale, scores, stride, out, sees, base);
      case 1: return attend_avx2<1>(q, ends, K, V, Dh, scale, scores, stride, out, sees, base);
      default: break;
    }
  }
#endif
  for (int i = 0; i < n; ++i) {
    if (sees != nullptr)
      attend_portable(q[i], K, V, ends[i], Dh, scale, scores + i * stride, out[i], sees[i],
                      base[i]);
    else
      attend_query(q[i], K, V, ends[i], Dh, scale, scores + i * stride, out[i], isa);
  }
}

}  // namespace clover
