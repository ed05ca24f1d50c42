// A llama-family decoder layer (RMSNorm, packed q/k/v with RoPE, attention over the KV cache,
// o, RMSNorm, packed gate/up, SiLU, down) in one call, for inference passes over the cache.
//
// Why: through PyTorch's modules, a decode step of a small model on a CPU is mostly the fixed
// cost of ~140 ops per layer (dispatch, allocation, casts), not the weights. Here a
// layer is one call: the residual stream stays float32 (more exact than the module path's
// bfloat16), matmul inputs are rounded to bfloat16 once for the quantized kernel, attention runs
// in float32 on the cache as it lies, and the layout's visibility rule (models/layout.py) is
// computed per query instead of read from a mask. The modules (models/llama.py) remain the
// reference; tests/test_kernels.py holds the two together.
#include <ATen/Parallel.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attention.h"
#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLOVER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLOVER_CLONES
#endif

namespace clover {
namespace fused {

// out [M, D] bfloat16 = x / rms(x) * w, x [M, D] float32
CLOVER_CLONES void rms_norm(const float* x, const float* w, int64_t M, int64_t D, float eps,
                            uint16_t* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
    const float r = 1.0f / std::sqrt(ss / D + eps);
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = to_bf16(xr[d] * r * w[d]);
  }
}

// In place on the first R dims of each head of one row: rotate-half RoPE with the signed sin
// of models/layers.py (`rope_cos_sin`): y[i] = x[i] cos[i] + x[(i + R/2) % R] sin[i]
CLOVER_CLONES void rope(float* x, int64_t heads, int64_t Dh, const float* cos, const float* sin,
                        int64_t R) {
  const int64_t half = R / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * Dh;
    float a[512];  // R <= 512 (checked by the layer)
    for (int64_t i = 0; i < half; ++i) {
      a[i] = v[i] * cos[i] + v[i + half] * sin[i];
      a[i + half] = v[i + half] * cos[i + half] + v[i] * sin[i + half];
    }
    std::memcpy(v, a, sizeof(float) * R);
  }
}

// float32 [n] -> bfloat16
CLOVER_CLONES void round_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
}

}  // namespace fused

namespace {

// Time spent per stage of the fused layers, when asked (`clover bench passes`): one clock read
// per stage, nothing when off.
enum Stage { kNorm, kQkv, kRopeCache, kAttention, kO, kGateUp, kSilu, kDown, kResidual, kStages };
const char* const kStageNames[kStages] = {"norms", "qkv", "rope+cache", "attention", "o",
                                          "gate_up", "silu*up", "down", "residual"};
bool profiling = false;
double stage_seconds[kStages] = {};

struct Clock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void lap(Stage s) {
    if (!profiling) return;
    const auto now = std::chrono::steady_clock::now();
    stage_seconds[s] += std::chrono::duration<double>(now - t).count();
    t = now;
  }
};

// float32 scratch that is written in full before it is read: not zeroed, unlike a vector
struct Buffer {
  explicit Buffer(int64_t n) : p(new float[n]) {}
  float* data() const { return p.get(); }
  std::unique_ptr<float[]> p;
};

constexpr int64_t kLoopAttentionRows = 64;  // wider passes use PyTorch's SDPA (prefill)

struct Layout {  // models/layout.py, per row: committed length, tokens committed, block tokens
  const int64_t *lengths, *n_commit, *n_block;
  int64_t B, T;
  // a tree of drafts (layout.tree_parts' sees, [B, T, W], W >= T): committed token t of row
  // b sees key lengths[b] - (W - T) + u (u < W: the pass's tokens and the W - T slots before
  // them) only where sees[(b * T + t) * W + u]; nullptr: a chain. Block tokens keep their rule
  // (the whole block)
  const uint8_t* sees = nullptr;
  int64_t W = 0;
  const uint8_t* row_sees(int64_t b, int64_t t) const {
    return sees == nullptr || t >= n_commit[b] ? nullptr : sees + (b * T + t) * W;
  }
  int64_t window(int64_t b) const { return lengths[b] - (W - T); }  // the first key sees covers
  // keys [0, end) are visible to query t of row b
  int64_t end(int64_t b, int64_t t) const {
    const int64_t nc = n_commit[b], nb = n_block[b];
    const bool block = t >= nc && t < nc + nb;
    return lengths[b] + (block ? nc + nb : t + 1);
  }
};

class FusedLayer {
 public:
  // qkv: one packed [q | k | v] matrix, or q, k and v apart (a GGUF whose v is in another
  // format than q and k, e.g. Q6_K beside Q4_K); gate_up: [gate | up], or the two apart
  FusedLayer(const at::Tensor& ln1, const at::Tensor& ln2, std::vector<Packed> qkv, Packed o,
             std::vector<Packed> gate_up, Packed down, int64_t n_heads, int64_t n_kv,
             int64_t head_dim, double eps, int64_t isa)
      : ln1_(ln1.to(at::kFloat).contiguous()),
        ln2_(ln2.to(at::kFloat).contiguous()),
        qkv_(std::move(qkv)),
        o_(std::move(o)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        hq_(n_heads),
        hkv_(n_kv),
        dh_(head_dim),
        eps_(static_cast<float>(eps)),
        isa_(isa) {
    const int64_t D = ln1_.numel();
    TORCH_CHECK(n_heads % n_kv == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(qkv_.size() == 1 || qkv_.size() == 3, "q/k/v: one packed matrix or three");
    TORCH_CHECK(gate_up_.size() == 1 || gate_up_.size() == 2, "gate/up: one matrix or two");
    nqkv_ = width(qkv_, D);
    const int64_t ngu = width(gate_up_, D);
    TORCH_CHECK(nqkv_ == (n_heads + 2 * n_kv) * head_dim, "q/k/v shape");
    TORCH_CHECK(o_.K == n_heads * head_dim && o_.N == D, "o shape");
    TORCH_CHECK(ngu % 2 == 0 && down_.K == ngu / 2 && down_.N == D, "gate/up/down shapes");
    TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0, "head_dim must be even and <= 512");
  }

  // per-head RMSNorms of q and k before RoPE (Qwen3's, and a drafter's layer): weights [Dh]
  void set_qk_norm(const at::Tensor& q_norm, const at::Tensor& k_norm, double eps) {
    TORCH_CHECK(q_norm.numel() == dh_ && k_norm.numel() == dh_, "q/k norms: [head_dim]");
    qn_ = q_norm.to(at::kFloat).contiguous();
    kn_ = k_norm.to(at::kFloat).contiguous();
    qk_eps_ = static_cast<float>(eps);
  }

  // x [B, T, D] float32, updated in place; k, v [B, Hkv, capacity, Dh] float32 caches;
  // lengths, n_commit, n_block [B] int64; cos, sin [B, T, R] float32
  // sees: None, or bool [B, T, W] (a tree of drafts: Layout::sees)
  void forward(at::Tensor& x, at::Tensor& k, at::Tensor& v, const at::Tensor& lengths,
               const at::Tensor& n_commit, const at::Tensor& n_block, const at::Tensor& cos,
               const at::Tensor& sin, const c10::optional<at::Tensor>& sees) {
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 3, "x");
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), M = B * T;
    TORCH_CHECK(D == ln1_.numel(), "x width");
    for (const at::Tensor* c : {&k, &v})
      TORCH_CHECK(c->is_contiguous() && c->scalar_type() == at::kFloat && c->dim() == 4 &&
                      c->size(0) == B && c->size(1) == hkv_ && c->size(3) == dh_,
                  "caches: contiguous float32 [B, Hkv, capacity, Dh]");
    for (const at::Tensor* t : {&lengths, &n_commit, &n_block})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong && t->numel() == B,
                  "lengths / n_commit / n_block: int64 [B]");
    const int64_t R = cos.size(-1);
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == M * R &&
                    sin.numel() == M * R && R <= dh_ && R % 2 == 0,
                "cos / sin: float32 [B, T, R]");
    Layout lay{lengths.data_ptr<int64_t>(), n_commit.data_ptr<int64_t>(),
               n_block.data_ptr<int64_t>(), B, T};
    if (sees.has_value()) {
      TORCH_CHECK(sees->is_contiguous() && sees->scalar_type() == at::kBool && sees->dim() == 3 &&
                      sees->size(0) == B && sees->size(1) == T && sees->size(2) >= T,
                  "sees: contiguous bool [B, T, W >= T]");
      lay.sees = reinterpret_cast<const uint8_t*>(sees->data_ptr<bool>());
      lay.W = sees->size(2);
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(lay.window(b) >= 0, "sees reaches before the cache");
    }
    const int64_t cap = k.size(2);
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lay.lengths[b] >= 0 && lay.lengths[b] + T <= cap, "cache too small");

    float* xp = x.data_ptr<float>();
    const int64_t F = down_.K, Nq = nqkv_;
    std::vector<uint16_t> hb(M * std::max(D, F));
    std::vector<float> xs(M * (std::max(D, F) / 16 + 1));
    // what the matmuls and the attention write in full is left uninitialized (a prefill's
    // gate/up output is large, and zeroing it first would write all of it twice)
    const Buffer qkv(M * Nq), att(M * hq_ * dh_);

    // attention half
    Clock clock;
    fused::rms_norm(xp, ln1_.data_ptr<float>(), M, D, eps_, hb.data());
    clock.lap(kNorm);
    matmul_parts(qkv_, hb.data(), xs.data(), M, Nq, qkv.data());
    clock.lap(kQkv);
    float* kc = k.data_ptr<float>();
    float* vc = v.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / T, t = m % T, slot = lay.lengths[b] + t;
      float* row = qkv.data() + m * Nq;
      if (qn_.defined()) {  // heads q then k: each x / rms(x) * w, in float32
        for (int64_t h = 0; h < hq_ + hkv_; ++h) {
          float* x = row + h * dh_;
          const float* w = (h < hq_ ? qn_ : kn_).data_ptr<float>();
          float ss = 0.f;
          for (int64_t d = 0; d < dh_; ++d) ss += x[d] * x[d];
          const float r = 1.0f / std::sqrt(ss / static_cast<float>(dh_) + qk_eps_);
          for (int64_t d = 0; d < dh_; ++d) x[d] = x[d] * r * w[d];
        }
      }
      fused::rope(row, hq_ + hkv_, dh_, cp + m * R, sp + m * R, R);
      for (int64_t h = 0; h < hkv_; ++h) {
        const int64_t at = ((b * hkv_ + h) * cap + slot) * dh_;
        std::memcpy(kc + at, row + (hq_ + h) * dh_, sizeof(float) * dh_);
        std::memcpy(vc + at, row + (hq_ + hkv_ + h) * dh_, sizeof(float) * dh_);
      }
    }
    clock.lap(kRopeCache);
    if (T > kLoopAttentionRows)
      attend_sdpa(qkv.data(), k, v, lay, att.data());
    else
      attend_loop(qkv.data(), kc, vc, cap, lay, att.data());
    fused::round_bf16(att.data(), M * hq_ * dh_, hb.data());
    clock.lap(kAttention);
    const Buffer y(M * D);
    matmul(o_, hb.data(), xs.data(), M, y.data());
    clock.lap(kO);
    add(xp, y.data(), M * D);
    clock.lap(kResidual);

    // feed-forward half
    fused::rms_norm(xp, ln2_.data_ptr<float>(), M, D, eps_, hb.data());
    clock.lap(kNorm);
    const Buffer gu(M * 2 * F);
    matmul_parts(gate_up_, hb.data(), xs.data(), M, 2 * F, gu.data());
    clock.lap(kGateUp);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        silu_mul(gu.data() + m * 2 * F, F, hb.data() + m * F, isa_level(isa_));
    });
    clock.lap(kSilu);
    matmul(down_, hb.data(), xs.data(), M, y.data());
    clock.lap(kDown);
    add(xp, y.data(), M * D);
    clock.lap(kResidual);
  }

 private:
  void matmul(const Packed& w, const uint16_t* xb, float* xs, int64_t M, float* out,
              int64_t ldo = 0) const {
    if (w.has_low) group_sums(xb, M, w.K, w.group, xs);
    qgemm_rows(w, xb, w.has_low ? xs : nullptr, M, out, nullptr, isa_, ldo);
  }

  // out [M, N] = the parts' outputs side by side (one part: straight into out)
  void matmul_parts(const std::vector<Packed>& parts, const uint16_t* xb, float* xs, int64_t M,
                    int64_t N, float* out) const {
    if (parts.size() == 1) return matmul(parts[0], xb, xs, M, out);
    int64_t at = 0;
    for (const Packed& w : parts) {  // each part writes its columns of out's rows
      matmul(w, xb, xs, M, out + at, N);
      at += w.N;
    }
  }

  static int64_t width(const std::vector<Packed>& parts, int64_t K) {
    int64_t n = 0;
    for (const Packed& w : parts) {
      TORCH_CHECK(w.K == K, "a projection's input width differs from the layer's");
      n += w.N;
    }
    return n;
  }

  static void add(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  // queries of the pass (rows of qkv) over the cache. From 16 tokens on (on AVX2 from 2), a
  // task is 4 consecutive tokens of one (row, head), which read each cached key and value
  // once (attend_queries); on AVX-512, shorter passes are as fast one query at a time
  // (`clover bench passes` times both)
  void attend_loop(const float* qkv, const float* kc, const float* vc, int64_t cap,
                   const Layout& lay, float* out) const {
    const int64_t T = lay.T, Nq = nqkv_, group = hq_ / hkv_;
    const int64_t per = T >= 16 || (isa_level(isa_) == 1 && T >= 2) ? 4 : 1;
    const int64_t chunks = (T + per - 1) / per;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dh_));
    at::parallel_for(0, lay.B * hq_ * chunks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores(4 * cap);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / (hq_ * chunks), h = i / chunks % hq_, t0 = i % chunks * per;
        const int64_t kvh = h / group;
        const float* K = kc + (b * hkv_ + kvh) * cap * dh_;
        const float* V = vc + (b * hkv_ + kvh) * cap * dh_;
        const float* q[4];
        float* o[4];
        int64_t ends[4], base[4];
        const uint8_t* sees[4];
        const int n = static_cast<int>(std::min<int64_t>(per, T - t0));
        for (int j = 0; j < n; ++j) {
          const int64_t m = b * T + t0 + j;
          q[j] = qkv + m * Nq + h * dh_;
          o[j] = out + (m * hq_ + h) * dh_;
          ends[j] = lay.end(b, t0 + j);
          sees[j] = lay.row_sees(b, t0 + j);
          base[j] = lay.sees == nullptr ? 0 : lay.window(b);
        }
        attend_queries(q, ends, n, K, V, dh_, scale, scores.data(), cap, o, isa_level(isa_),
                       lay.sees == nullptr ? nullptr : sees, base);
      }
    });
  }

  // wide passes (prefill): PyTorch's fused attention, causal or under the layout's mask
  void attend_sdpa(const float* qkv, const at::Tensor& k, const at::Tensor& v,
                   const Layout& lay, float* out) const {
    const int64_t B = lay.B, T = lay.T;
    int64_t S = 0;
    for (int64_t b = 0; b < B; ++b) S = std::max(S, lay.lengths[b] + T);
    auto opts = k.options();
    const at::Tensor all =
        at::from_blob(const_cast<float*>(qkv), {B, T, nqkv_ / dh_, dh_}, opts);
    const at::Tensor q = all.narrow(2, 0, hq_).transpose(1, 2);  // [B, Hq, T, Dh]
    const at::Tensor ks = k.narrow(2, 0, S), vs = v.narrow(2, 0, S);
    bool first = true;  // a first prefill: no cached prefix, no block tokens
    for (int64_t b = 0; b < B; ++b) first = first && lay.lengths[b] == 0 && lay.n_block[b] == 0;
    first = first && lay.sees == nullptr;
    // plain causal (first): SDPA skips the masked half, which under an explicit mask it cannot
    c10::optional<at::Tensor> mask;
    if (!first) {
      mask = at::empty({B, 1, T, S}, opts.dtype(at::kBool));
      bool* mp = mask->data_ptr<bool>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t e = lay.end(b, t), L = lay.sees == nullptr ? 0 : lay.window(b);
          const uint8_t* seen = lay.row_sees(b, t);
          for (int64_t s = 0; s < S; ++s)
            mp[(b * T + t) * S + s] = s < e && (seen == nullptr || s < L || seen[s - L]);
        }
    }
    const at::Tensor o = at::scaled_dot_product_attention(q, ks, vs, mask, 0.0, first,
                                                          c10::nullopt, hq_ != hkv_);
    at::Tensor dst = at::from_blob(out, {B, T, hq_, dh_}, opts);
    dst.copy_(o.transpose(1, 2));
  }

  at::Tensor ln1_, ln2_;
  at::Tensor qn_, kn_;  // per-head q/k norms, or undefined
  float qk_eps_ = 0.f;
  std::vector<Packed> qkv_;
  Packed o_;
  std::vector<Packed> gate_up_;
  Packed down_;
  int64_t nqkv_ = 0;  // q/k/v outputs, over all parts
  int64_t hq_, hkv_, dh_;
  float eps_;
  int64_t isa_;
};

// rows of x [M, D] float32 -> bfloat16 [M, D] = x / rms(x) * w (the final norm)
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32");
  const at::Tensor wf = w.to(at::kFloat).contiguous();
  const int64_t D = x.size(-1), M = x.numel() / D;
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  fused::rms_norm(x.data_ptr<float>(), wf.data_ptr<float>(), M, D, static_cast<float>(eps),
                  reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

// rows of gu [M, 2F] float32 ([gate | up]) -> bfloat16 [M, F] = silu(gate) * up, as the fused
// layers compute it on kernel path `isa` (tests hold the paths to each other and to PyTorch)
at::Tensor silu_mul_bf16(const at::Tensor& gu, int64_t isa) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gu: [M, 2F]");
  const at::Tensor g = gu.to(at::kFloat).contiguous();
  const int64_t M = g.size(0), F = g.size(1) / 2;
  at::Tensor out = at::empty({M, F}, g.options().dtype(at::kBFloat16));
  for (int64_t m = 0; m < M; ++m)
    silu_mul(g.data_ptr<float>() + m * 2 * F, F,
             reinterpret_cast<uint16_t*>(out.data_ptr()) + m * F, isa_level(isa));
  return out;
}

// out [n, Dh] = attention of queries q [n, Dh] over K, V [S, Dh], query i over keys
// [0, ends[i]), 4 queries a call as the fused layers take them (tests hold it to a reference)
at::Tensor attention(const at::Tensor& q, const at::Tensor& K, const at::Tensor& V,
                     const at::Tensor& ends, int64_t isa) {
  TORCH_CHECK(q.dim() == 2 && K.dim() == 2 && V.sizes() == K.sizes() && q.size(1) == K.size(1),
              "q [n, Dh], K and V [S, Dh]");
  const at::Tensor qc = q.to(at::kFloat).contiguous(), kc = K.to(at::kFloat).contiguous(),
                   vc = V.to(at::kFloat).contiguous(), ec = ends.to(at::kLong).contiguous();
  const int64_t n = q.size(0), Dh = q.size(1), S = K.size(0);
  TORCH_CHECK(ec.numel() == n, "one end per query");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ec.data_ptr<int64_t>()[i] >= 1 && ec.data_ptr<int64_t>()[i] <= S, "ends in 1..S");
  at::Tensor out = at::empty({n, Dh}, qc.options());
  std::vector<float> scores(4 * S);
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int c = static_cast<int>(std::min<int64_t>(4, n - i0));
    const float* qp[4];
    float* op[4];
    for (int j = 0; j < c; ++j) {
      qp[j] = qc.data_ptr<float>() + (i0 + j) * Dh;
      op[j] = out.data_ptr<float>() + (i0 + j) * Dh;
    }
    attend_queries(qp, ec.data_ptr<int64_t>() + i0, c, kc.data_ptr<float>(), vc.data_ptr<float>(),
                   Dh, 1.0f / std::sqrt(static_cast<float>(Dh)), scores.data(), S, op,
                   isa_level(isa));
  }
  return out;
}

// profile(True) zeroes and starts the stage clocks; profile(False) stops them and returns
// {stage: seconds} summed over every fused layer call since the start
std::map<std::string, double> profile(bool on) {
  std::map<std::string, double> out;
  for (int s = 0; s < kStages; ++s) out[kStageNames[s]] = stage_seconds[s];
  if (on) std::fill(stage_seconds, stage_seconds + kStages, 0.0);
  profiling = on;
  return out;
}

}  // namespace

void register_layer(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Packed>(m, "Packed")
      .def(py::init(&make_packed), py::arg("q"), py::arg("scales"), py::arg("bits"),
           py::arg("group"), py::arg("has_low"), py::arg("N"), py::arg("K"), py::arg("bias"),
           py::arg("mults") = py::none(), py::arg("bases") = py::none());
  py::class_<FusedLayer>(m, "FusedLayer")
      .def(py::init<const at::Tensor&, const at::Tensor&, std::vector<Packed>, Packed,
                    std::vector<Packed>, Packed, int64_t, int64_t, int64_t, double, int64_t>())
      .def("forward", &FusedLayer::forward)
      .def("set_qk_norm", &FusedLayer::set_qk_norm);
  m.def("rms_norm_bf16", &rms_norm_bf16, "the final RMSNorm of a fused backbone");
  m.def("attention", &attention, "attention over a cache, as the fused layers run it");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up, as the fused layers run it");
  m.def("profile", &profile, "stage clocks of the fused layers: on, or off (returns seconds)");
}

}  // namespace clover
