// Python bindings of Clover's CPU kernels (built on first use by clover/kernels/__init__.py):
// argument checks, output allocation and the split of the work over PyTorch's threads.
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstdlib>
#include <torch/extension.h>

#include "ops.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace clover {

namespace {

// AMX tiles (cpuid 7.0: EDX bit 24 AMX-TILE, bit 22 AMX-BF16), usable once Linux grants this
// process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; asked once)
bool amx_usable() {
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace

int64_t best_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return amx_usable() ? 3 : 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

bool int8_dots_supported() { return best_isa() >= 1; }

namespace {

// integer dots on kernel path `isa`: AVX-512 VNNI (qgemm_vnni.cpp) from level 2 where the CPU
// has it, else AVX2 (qgemm_dots_avx2.cpp), the same results to the bit
bool dots_on_vnni(int64_t isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool vnni = best_isa() >= 2 && __builtin_cpu_supports("avx512vnni");
  return vnni && isa_level(isa) >= 2;
#else
  return false;
#endif
}

}  // namespace

// Rows a pass may have and still take the integer dots. VNNI: up to 4 (AMX's bfloat16 tiles
// cost as much from 3 rows on), and up to 16 where 4- to 6-bit weights take x on one plane
// (kX8; 8-bit weights keep two planes in blocks of 4 rows): there the dots beat the bfloat16
// path up to 16 rows and not beyond. AVX2: up to 16, where the dots cost no more than the
// float path. `clover bench passes` times both sides (docs/kernels.md).
int64_t int8_dots_rows(int64_t isa) {
  if (!(isa & kInt8Dots)) return 0;
  return dots_on_vnni(isa) && !(isa & kX8) ? 4 : 16;
}

namespace {

using TileFn = void (*)(const QGemm&, int64_t, int64_t);

TileFn tile_fn(int64_t isa) {
  const int level = isa_level(isa);
  TORCH_CHECK(isa >= 0 && isa < 32 && level <= best_isa(), "kernel path ", isa,
              " not supported by this CPU");
  TORCH_CHECK(!(isa & kInt8Dots) || level >= 1,
              "integer dots need AVX2 (kernel path level 1 or more)");
  TORCH_CHECK(!(isa & kX8) || (isa & kInt8Dots), "8-bit x is a mode of the integer dots");
  return level == 3   ? qgemm_tiles_amx
         : level == 2 ? qgemm_tiles_avx512
         : level == 1 ? qgemm_tiles_avx2
                      : qgemm_tiles_scalar;
}

// x [..., K] (float32 or bfloat16) -> bfloat16 [M, K] and, for affine levels, its sums per
// group [M, K / group] (float32, of the rounded values: what the kernel multiplies)
void prepare_x(const at::Tensor& x, int64_t group, bool has_low, at::Tensor& xb, at::Tensor& xs) {
  const int64_t K = x.size(-1), M = x.numel() / K, G = K / group;
  if (x.scalar_type() == at::kBFloat16) {
    xb = x.reshape({M, K}).contiguous();
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    const at::Tensor xf = x.reshape({M, K}).contiguous();
    xb = at::empty({M, K}, x.options().dtype(at::kBFloat16));
    const float* src = xf.data_ptr<float>();
    uint16_t* dst = reinterpret_cast<uint16_t*>(xb.data_ptr());
    for (int64_t i = 0; i < M * K; ++i) dst[i] = to_bf16(src[i]);
  }
  if (!has_low) return;
  xs = at::empty({M, G}, x.options().dtype(at::kFloat));
  group_sums(reinterpret_cast<const uint16_t*>(xb.data_ptr()), M, K, group, xs.data_ptr<float>());
}

}  // namespace

void group_sums(const uint16_t* xb, int64_t M, int64_t K, int64_t group, float* xs) {
  for (int64_t i = 0; i < M * (K / group); ++i) {
    float acc = 0.f;
    for (int64_t k = 0; k < group; ++k) acc += from_bf16(xb[i * group + k]);
    xs[i] = acc;
  }
}

Packed make_packed(const at::Tensor& q, const at::Tensor& scales, int64_t bits, int64_t group,
                   bool has_low, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& mults, const c10::optional<at::Tensor>& bases) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  TORCH_CHECK(bits == 8   ? (group == 16 || group == 32)
              : bits == 6 ? group == 16
                          : group == 32,
              "unsupported group ", group);
  TORCH_CHECK(N % 16 == 0 && K % group == 0, "N must be a multiple of 16 and K of the group");
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == at::kByte, "q: contiguous uint8");
  TORCH_CHECK(q.numel() == N / 16 * (K / group) * tile_bytes(static_cast<int>(bits),
                                                              static_cast<int>(group)),
              "q holds ", q.numel(), " bytes");
  TORCH_CHECK(scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "scales: contiguous float32 or float16");
  TORCH_CHECK(scales.numel() == (has_low ? 2 : 1) * N * (K / group), "scales: wrong size");
  Packed p;
  p.q = q, p.scales = scales, p.bits = bits, p.group = group, p.N = N, p.K = K;
  p.has_low = has_low;
  if (bias.has_value() && bias->defined()) {
    p.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(p.bias.numel() == N, "bias must have N values");
  }
  const bool m = mults.has_value() && mults->defined(), b = bases.has_value() && bases->defined();
  TORCH_CHECK(m == b, "compact scales: mults and bases together");
  if (m) {
    const int64_t G = K / group, per = 256 / group, parts = has_low ? 2 : 1;
    TORCH_CHECK(G % per == 0, "compact scales: K a multiple of 256");
    TORCH_CHECK(mults->is_contiguous() && mults->scalar_type() == at::kChar &&
                    mults->numel() == parts * N * G,
                "compact scales: mults int8 [N/16, G, parts, 16]");
    TORCH_CHECK(bases->is_contiguous() && bases->scalar_type() == at::kFloat &&
                    bases->numel() == parts * N * (G / per),
                "compact scales: bases float32 [N/16, G/(256/group), parts, 16]");
    p.mults = *mults, p.bases = *bases;
  }
  return p;
}

// Rows of x per sweep over the weights: 192 (a multiple of every kernel's own block of rows),
// so x stays in cache; a wide pass taken all at once, or in sweeps of 384, runs slower.
// `$CLOVER_QGEMM_ROWS` overrides it, rounded up to a multiple of 192 (0: all rows at once).
int64_t row_chunk() {
  if (const char* forced = std::getenv("CLOVER_QGEMM_ROWS")) {
    const int64_t v = std::atoll(forced);
    return v > 0 ? (v + 191) / 192 * 192 : INT64_MAX / 4;
  }
  return 192;
}

void qgemm_rows(const Packed& w, const uint16_t* xb, const float* xs, int64_t M, float* out_f32,
                uint16_t* out_bf16, int64_t isa, int64_t ldo) {
  QGemm a;
  a.bits = static_cast<int>(w.bits);
  a.group = static_cast<int>(w.group);
  a.has_low = w.has_low;
  a.f16_scales = w.scales.scalar_type() == at::kHalf;
  a.M = M, a.N = w.N, a.K = w.K;
  a.xb = xb;
  a.xsum = xs;
  a.q = w.q.data_ptr<uint8_t>();
  a.scales = w.scales.data_ptr();
  a.bias = w.bias.defined() ? w.bias.data_ptr<float>() : nullptr;
  a.out_f32 = out_f32;
  a.out_bf16 = out_bf16;
  a.ldo = ldo;
  const int64_t stride = a.out_stride();
  TORCH_CHECK(stride >= w.N, "output rows ", stride, " apart hold fewer than N = ", w.N);
  TileFn fn = tile_fn(isa);
  std::vector<int8_t> xq;
  std::vector<float> xd;
  std::vector<int32_t> xqs;
  if (M <= int8_dots_rows(isa)) {
    a.x_planes = (isa & kX8) && w.bits != 8 ? 1 : 2;  // x on one 8-bit plane (kX8, 4-6 bits)
    const bool vnni = dots_on_vnni(isa);
    const int64_t G = w.K / w.group;
    xq.resize(a.x_planes * M * w.K), xd.resize(M * G), xqs.resize(M * G);
    const int group = static_cast<int>(w.group), bits = static_cast<int>(w.bits);
    if (vnni && a.x_planes == 2)
      quantize_rows(xb, M, w.K, group, bits, xq.data(), xd.data(), xqs.data());
    else
      quantize_rows_avx2(xb, M, w.K, group, bits, xq.data(), xd.data(), xqs.data(), a.x_planes);
    a.xq = xq.data(), a.xd = xd.data(), a.xqs = xqs.data();
    if (w.mults.defined()) {
      a.mults = w.mults.data_ptr<int8_t>();
      a.bases = w.bases.data_ptr<float>();
      a.base_shift = w.group == 32 ? 3 : 4;
    }
    fn = vnni ? qgemm_tiles_vnni : qgemm_tiles_dots_avx2;
  } else if ((isa & kInt8Dots) && isa_level(isa) == 1) {
    fn = qgemm_tiles_wide_avx2;  // wider passes: float32 weights, rows in registers
  }
  // A long pass (a prefill, a drafter's features) sweeps the weights once per chunk of rows:
  // the kernels take tile after tile of weights over every row of x, so with all rows at once
  // x (up to M x K bfloat16, MBs) came back from memory for each of the N / 16 tiles.
  const int64_t chunk = M > int8_dots_rows(isa) ? row_chunk() : M;
  for (int64_t m0 = 0; m0 < M;) {
    // the last chunk takes what is left of two: every chunk starts on a multiple of 192 rows,
    // so each row meets the kernels' own blocks (16, 64, 96 rows) as in one sweep
    const int64_t rows = M - m0 >= 2 * chunk ? chunk : M - m0;
    QGemm c = a;
    c.M = rows;
    c.xb = xb + m0 * w.K;
    if (xs != nullptr) c.xsum = xs + m0 * (w.K / w.group);
    if (out_f32 != nullptr) c.out_f32 = out_f32 + m0 * stride;
    if (out_bf16 != nullptr) c.out_bf16 = out_bf16 + m0 * stride;
    at::parallel_for(0, w.N / 16, 1, [&](int64_t t0, int64_t t1) { fn(c, t0, t1); });
    m0 += rows;
  }
}

namespace {

// y [..., N] = x [..., K] . W^T (+ bias); W packed as qgemm.h describes
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t bits,
                 int64_t group, bool has_low, int64_t N, const c10::optional<at::Tensor>& bias,
                 bool out_bf16, int64_t isa, const c10::optional<at::Tensor>& mults,
                 const c10::optional<at::Tensor>& bases) {
  const Packed w = make_packed(q, scales, bits, group, has_low, N, x.size(-1), bias, mults, bases);
  at::Tensor xb, xs;
  prepare_x(x, group, has_low, xb, xs);
  const int64_t M = xb.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  qgemm_rows(w, reinterpret_cast<const uint16_t*>(xb.data_ptr()),
             has_low ? xs.data_ptr<float>() : nullptr, M,
             out_bf16 ? nullptr : out.data_ptr<float>(),
             out_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr, isa);
  return out.view(sizes);
}

// The level of row n at k and its group's scale/low, read back from the packed layout.
at::Tensor unpack_levels(const at::Tensor& q, int64_t bits, int64_t group, int64_t N, int64_t K) {
  QGemm a;
  a.bits = static_cast<int>(bits), a.group = static_cast<int>(group), a.N = N, a.K = K;
  a.q = q.data_ptr<uint8_t>();
  at::Tensor out = at::empty({N, K}, at::kInt);
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) o[n * K + k] = level_at(a, n, k);
  return out;
}

}  // namespace
}  // namespace clover

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("best_isa", &clover::best_isa, "3: AMX + AVX-512 BF16, 2: AVX-512 BF16, 1: AVX2 + FMA, 0: portable");
  m.def("int8_dots_supported", &clover::int8_dots_supported,
        "whether kernel paths of level 1 or more may add 8: integer dots for short passes "
        "(AVX-512 VNNI: 1 to 4 rows, 16 with 8-bit x; else AVX2: 1 to 16)");
  m.def("int8_dots_rows", &clover::int8_dots_rows,
        "passes of up to this many rows take integer dots on a kernel path (0: none)");
  m.def("qgemm", &clover::qgemm, "quantized matmul (qgemm.h)");
  m.def("unpack_levels", &clover::unpack_levels, "levels [N, K] from the packed layout");
  clover::register_layer(m);
}
