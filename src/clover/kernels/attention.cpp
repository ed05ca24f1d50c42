// Attention of one query over keys [0, end) of one head of the KV cache, float32:
// out [Dh] = softmax(q . K^T * scale) V, K and V [capacity, Dh] row-major as the cache holds
// them. Two paths: portable loops (any CPU), and AVX-512 for Dh a multiple of 16, which takes
// the dots of 16 keys at once (16 accumulators, then a transposing reduction tree) instead of
// reducing every key's vector separately: ~6 instructions a key instead of ~20.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace clover {

static void attend_portable(const float* q, const float* K, const float* V, int64_t end,
                            int64_t Dh, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t s = 0; s < end; ++s) {
    float acc = 0.f;
    for (int64_t d = 0; d < Dh; ++d) acc += q[d] * K[s * Dh + d];
    scores[s] = acc * scale;
    top = std::max(top, scores[s]);
  }
  float total = 0.f;
  for (int64_t s = 0; s < end; ++s) {
    scores[s] = exp_approx(scores[s] - top);
    total += scores[s];
  }
  std::fill(out, out + Dh, 0.f);
  for (int64_t s = 0; s < end; ++s) {
    const float p = scores[s] / total;
    for (int64_t d = 0; d < Dh; ++d) out[d] += p * V[s * Dh + d];
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
#endif

void attend_query(const float* q, const float* K, const float* V, int64_t end, int64_t Dh,
                  float scale, float* scores, float* out, bool avx512) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512 && Dh % 16 == 0) return attend_avx512(q, K, V, end, Dh, scale, scores, out);
#endif
  attend_portable(q, K, V, end, Dh, scale, scores, out);
}

}  // namespace clover
