// Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// W is stored in tiles of 16 output rows x one quantization group of k, so that one load +
// unpack yields, for each pair of k, a vector of 16 rows x 2 k as bfloat16 levels: the operand
// of one `vdpbf16ps` against the pair of x values broadcast to every lane. A tile is unpacked
// once per pass and used for every row of x, so a pass of M rows reads and unpacks the weights
// once (the aten int4 kernel re-reads them per 4 rows of x).
//
// Levels are small integers, exact in bfloat16, and x is rounded to bfloat16 once, so every
// product is exact in float32; each group's dot is then scaled:
//   y[m, n] = sum_g  scale[n, g] * dot_g(x[m], q[n]) + low[n, g] * sum_g(x[m])
// which is the same as multiplying by the dequantized weights, without rounding them.
//
// Layouts (NT = N / 16 tiles, G = K / group groups):
//   int4 (group 32): q [NT, G, 4, 32] uint16 words, 4 nibbles each: word w of chunk c holds,
//     in nibble j, the level of row 16t + w / 2 at k = 32g + 8c + 2j + w % 2.
//   int5 (group 32, levels -16..15: GGUF Q5_0's): q [NT, G, 320] bytes: the int4 layout of
//     (level + 16) & 15, then 16 uint32 masks, one per pair p = 4c + j, whose bit w is
//     (level + 16) >> 4 of that word's nibble j (5.5 bits a weight with float16 scales).
//   int6 (group 16, levels -32..31: GGUF Q6_K's): q [NT, G, 192] bytes: the int4 layout of
//     (level + 32) & 15 (two chunks for the group's 16 k), then 8 uint32 masks of bit 4 of
//     level + 32, one per pair p = 4c + j as int5's, then 8 of bit 5 (6 bits a weight).
//   int8 (group 16 or 32): q [NT, G, group / 2, 32] int8: byte w of pair p is row 16t + w / 2
//     at k = group * g + 2p + w % 2.
//   scales [NT, G, 16] (then lows [NT, G, 16] when present), float32 or float16.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace clover {

struct QGemm {
  int bits = 4;           // 4, 5, 6 or 8
  int group = 32;         // k per scale: 32 for int4/int5, 16 for int6; 16 or 32 for int8
  bool has_low = true;    // affine levels (a low per group) or symmetric
  bool f16_scales = false;
  int64_t M = 0, N = 0, K = 0;
  const uint16_t* xb = nullptr;  // x rounded to bfloat16 [M, K]
  const float* xsum = nullptr;   // [M, K / group]: sum of xb per group (has_low only)
  const uint8_t* q = nullptr;
  const void* scales = nullptr;  // [NT, G, 16] scales, then [NT, G, 16] lows if has_low
  const float* bias = nullptr;   // [N] or null
  float* out_f32 = nullptr;      // [M, N] rows ldo apart, one of the two outputs
  uint16_t* out_bf16 = nullptr;
  int64_t ldo = 0;  // output rows this far apart (0: N); parts of a wider output set it
  int64_t out_stride() const { return ldo > 0 ? ldo : N; }
  // the integer-dot paths (qgemm_vnni.cpp, qgemm_dots_avx2.cpp): x rounded per group, in the
  // weights' order
  const int8_t* xq = nullptr;    // [M, 2, K]: high and low int8 planes, x_q = 128 high + low
  const float* xd = nullptr;     // [M, G]: each group's step d (x ~ d * x_q)
  const int32_t* xqs = nullptr;  // [M, G]: sum of x_q per group
  // 4-, 5- and 6-bit weights on the dots: x_q on 2 planes (15 bits) or on 1 (8 bits: in
  // -127..127, d = max |x| / 127; kernel path flag kX8). 8-bit weights keep 2 (their int16
  // x_q takes the bytes of two planes): K * x_planes bytes of xq a row
  int x_planes = 2;
  // the integer dots only: the scales (and lows) as int8 multiples of a float32 base per 256
  // values of k (qgemm.py's `pack_compact`), read instead of `scales` when set: mults [NT, G,
  // 1 or 2, 16] int8, bases [NT, G >> base_shift, 1 or 2, 16]; float32(mult) * base is the
  // scale
  const int8_t* mults = nullptr;
  const float* bases = nullptr;
  int base_shift = 3;  // log2 of the groups a base (8 for groups of 32, 16 for 16)
};

// Rows [r0, r0 + rows) of an integer-dot pass as a pass of their own (their x, steps, sums and
// output rows; the same weights): one block of a kernel that takes rows in blocks
inline QGemm row_block(const QGemm& a, int64_t r0, int64_t rows) {
  const int64_t G = a.K / a.group;
  QGemm b = a;
  b.M = rows;
  b.xq = a.xq + a.x_planes * r0 * a.K;  // x_planes K bytes a row (int8 weights: int16 x)
  b.xd = a.xd + r0 * G;
  b.xqs = a.xqs + r0 * G;
  if (a.xsum) b.xsum = a.xsum + r0 * G;
  // outputs: row r of the block at (r0 + r) * ldo; the kernels write r * ldo + 16 t
  if (a.out_f32) b.out_f32 = a.out_f32 + r0 * a.out_stride();
  if (a.out_bf16) b.out_bf16 = a.out_bf16 + r0 * a.out_stride();
  return b;
}

// Bytes of one tile's group (16 rows x `group` k) in the layout of `bits`
constexpr int64_t tile_bytes(int bits, int group) {
  return bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 192 : 16 * group;
}

// Where a tile's group keeps the 32-bit masks of one high bit of its levels, after the group's
// nibbles (8 group bytes), 2 group bytes a plane: int5's bit 4 (group 32, plane 0: byte 256),
// int6's bits 4 and 5 (group 16, planes 0 and 1: bytes 128 and 160)
constexpr int64_t mask_offset(int group, int plane) { return 8 * group + 2 * group * plane; }

// Calls f(P, BITS, LOW, F16) with compile-time constants (std::integral_constant) for the
// weights' format: P pairs of k per group (16; 8 for groups of 16), BITS 4, 5, 6 or 8,
// affine levels (LOW) or not, float16 scales or not. Each instruction set instantiates its
// kernel through this one switch.
template <class F>
inline void dispatch_format(const QGemm& a, F&& f) {
  using Y = std::true_type;
  using N = std::false_type;
  const auto scales = [&](auto P, auto BITS) {
    if (a.has_low)
      a.f16_scales ? f(P, BITS, Y{}, Y{}) : f(P, BITS, Y{}, N{});
    else
      a.f16_scales ? f(P, BITS, N{}, Y{}) : f(P, BITS, N{}, N{});
  };
  using I16 = std::integral_constant<int, 16>;
  if (a.bits == 4)
    scales(I16{}, std::integral_constant<int, 4>{});
  else if (a.bits == 5)
    scales(I16{}, std::integral_constant<int, 5>{});
  else if (a.bits == 6)
    scales(std::integral_constant<int, 8>{}, std::integral_constant<int, 6>{});
  else if (a.group == 32)
    scales(I16{}, std::integral_constant<int, 8>{});
  else
    scales(std::integral_constant<int, 8>{}, std::integral_constant<int, 8>{});
}

// Output tiles [t0, t1) (16 columns each), every row of x. One per instruction set.
void qgemm_tiles_scalar(const QGemm& a, int64_t t0, int64_t t1);
void qgemm_tiles_avx2(const QGemm& a, int64_t t0, int64_t t1);
// AVX2 passes wider than the integer dots take: float32 weights per tile, rows in registers
void qgemm_tiles_wide_avx2(const QGemm& a, int64_t t0, int64_t t1);
void qgemm_tiles_avx512(const QGemm& a, int64_t t0, int64_t t1);
void qgemm_tiles_amx(const QGemm& a, int64_t t0, int64_t t1);  // AVX-512 for one row
// integer dots on two int8 planes of x, or one for 4- to 6-bit weights (AVX-512 VNNI): any
// rows (qgemm_rows: up to 4 on two planes, 16 on one)
void qgemm_tiles_vnni(const QGemm& a, int64_t t0, int64_t t1);
// the same dots on AVX2 (qgemm_dots_avx2.cpp), to the bit: any rows (qgemm_rows: up to 16)
void qgemm_tiles_dots_avx2(const QGemm& a, int64_t t0, int64_t t1);

// The integer-dot paths round x per group to x_q in -kXMax..kXMax (the high plane in
// -127..127): both must use this one bound to agree to the bit.
constexpr int kXMax = 127 * 128;

// xb [M, K] bfloat16 -> x_q [M, 2, K] (per group: x_q = round(x * 16256 / max |x|) as two int8
// planes, in the order qgemm_tiles_vnni reads for `bits`), d = max |x| / 16256 [M, G], sum of
// x_q [M, G] (AVX-512)
void quantize_rows(const uint16_t* xb, int64_t M, int64_t K, int group, int bits, int8_t* xq,
                   float* xd, int32_t* xqs);
// the same on AVX2, for qgemm_tiles_dots_avx2: the same x_q, d and sums, but for 8-bit weights
// x_q is written as int16 [M, K] (in the same 2K bytes a row) instead of two planes; with
// planes 1 (4- to 6-bit weights only) x_q = round(x * 127 / max |x|) on one plane [M, K]
void quantize_rows_avx2(const uint16_t* xb, int64_t M, int64_t K, int group, int bits,
                        int8_t* xq, float* xd, int32_t* xqs, int planes);

// The level of row n at k, and the scale/low of (n, group), read from the packed layout
// (the scalar path and tests of the layout use these).
int level_at(const QGemm& a, int64_t n, int64_t k);
float scale_at(const QGemm& a, int64_t n, int64_t g, bool low);

// float32 -> bfloat16 bits, rounded to nearest even as torch's .to(bfloat16); inline and
// branch-free so that loops over rows vectorize
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float from_f16(uint16_t h);

}  // namespace clover
