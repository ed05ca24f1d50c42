// What the binding files share: a packed weight as tensors, and the threaded matmul over it.
#pragma once
#include <torch/extension.h>

#include "qgemm.h"

namespace clover {

struct Packed {  // a QWeight of clover/kernels/qgemm.py
  at::Tensor q, scales, bias;  // bias: float32 [N] or undefined
  at::Tensor mults, bases;     // compact scales for the integer dots, or undefined
  int64_t bits = 4, group = 32, N = 0, K = 0;
  bool has_low = true;
};

Packed make_packed(const at::Tensor& q, const at::Tensor& scales, int64_t bits, int64_t group,
                   bool has_low, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& mults = c10::nullopt,
                   const c10::optional<at::Tensor>& bases = c10::nullopt);

// out [M, N] (float32 or bfloat16: the one not null; rows ldo apart, 0: N) = xb [M, K] . W^T
// (+ bias), over PyTorch's threads. xs: xb's sums per group (affine weights only).
void qgemm_rows(const Packed& w, const uint16_t* xb, const float* xs, int64_t M, float* out_f32,
                uint16_t* out_bf16, int64_t isa, int64_t ldo = 0);

// xs [M, K / group] = sums of xb [M, K] per group
void group_sums(const uint16_t* xb, int64_t M, int64_t K, int64_t group, float* xs);

int64_t best_isa();

// A kernel path is an instruction-set level (0 portable, 1 AVX2, 2 AVX-512 BF16, 3 + AMX),
// plus this flag where short passes (int8_dots_rows: 4 with VNNI, 16 with VNNI and kX8 or on
// AVX2) take integer dots on int8 planes of x (qgemm_vnni.cpp, qgemm_dots_avx2.cpp)
constexpr int64_t kInt8Dots = 8;
// with kInt8Dots: 4- to 6-bit weights take x rounded to 8 bits per group on one plane (VNNI
// where the CPU has it, else AVX2: the same results), half the multiplies a row of a short pass
constexpr int64_t kX8 = 16;
inline int isa_level(int64_t isa) { return static_cast<int>(isa & 7); }
bool int8_dots_supported();
// passes of up to this many rows take the integer dots on kernel path `isa` (0: none)
int64_t int8_dots_rows(int64_t isa);

void register_layer(pybind11::module& m);

}  // namespace clover
