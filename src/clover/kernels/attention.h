// Attention over the KV cache for the fused layers (attention.cpp), and the exp it shares with
// their SiLU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace clover {

// e^x for x <= 88: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor (relative
// error ~2e-7; float32's own rounding is 6e-8). Inline: loops over it vectorize.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// out [Dh] = softmax(q . K[:end]^T * scale) V[:end]; scores: scratch of >= end floats.
// isa: the kernels' instruction set (kernels/__init__.py): >= 2 AVX-512 F/DQ (used when Dh is
// a multiple of 16), 1 AVX2 + FMA (Dh a multiple of 8), 0 portable loops.
void attend_query(const float* q, const float* K, const float* V, int64_t end, int64_t Dh,
                  float scale, float* scores, float* out, int isa);

// The same for n <= 4 queries of one head (tokens of one pass), query i over keys
// [0, ends[i]); scores: scratch of n x `stride` (>= every end) floats. With AVX-512 or AVX2
// the key and value rows are read once for all n queries. `sees` (a tree of drafts): query
// i sees key base[i] + u only where sees[i][u] != 0 (u: the key's place in the pass).
void attend_queries(const float* const* q, const int64_t* ends, int n, const float* K,
                    const float* V, int64_t Dh, float scale, float* scores, int64_t stride,
                    float* const* out, int isa, const uint8_t* const* sees = nullptr,
                    const int64_t* base = nullptr);

// out [F] bfloat16 = silu(gate) * up for one row of gu [gate (F) | up (F)], with exp_approx;
// isa >= 1: 8 lanes (AVX2 + FMA). The portable loop does not vectorize (exp_approx's clamp
// is a branch there), which makes it a visible share of every row of a small model's pass.
void silu_mul(const float* gu, int64_t F, uint16_t* out, int isa);

}  // namespace clover
