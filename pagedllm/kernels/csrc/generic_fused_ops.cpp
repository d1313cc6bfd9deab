// The elementwise fusions of fused_ops.cpp (RMSNorm with the residual add, rotary in place,
// SiLU-and-mul) in plain C++, for the tiers without AVX-512: the compiler vectorizes the loops for
// the tier's -m flags (AVX2 with FMA; the same source compiles for aarch64), with AVX2 intrinsics
// where it cannot (SiLU's exp). Same contract and roundings as fused_ops.cpp: rounded to the
// storage dtype wherever the torch path rounds.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops.h"

#ifdef __AVX2__
#include "vec_avx2.h"
#endif

namespace {

constexpr int64_t kGrainElements = 1 << 14;  // as fused_ops.cpp: small calls stay on one thread

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1)); }

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
// v stored in T and read back (round to nearest even for bf16, as torch casts).
inline float round_to(const float*, float v) { return v; }
inline float round_to(const c10::BFloat16*, float v) { return static_cast<float>(c10::BFloat16(v)); }
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

template <typename F>
void dispatch_float_types(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expects [rows, features] with contiguous rows");
}

// out = weight * round(x / rms(x)), rounded; 16 partial sums of squares (one vector's lanes).
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  float partial[16] = {};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)
    for (int j = 0; j < 16; ++j) partial[j] += to_f32(x[i + j]) * to_f32(x[i + j]);
  for (; i < H; ++i) partial[i % 16] += to_f32(x[i]) * to_f32(x[i]);
  float ss = 0.0f;
  for (float p : partial) ss += p;
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t k = 0; k < H; ++k) store(out + k, to_f32(w[k]) * round_to(x, to_f32(x[k]) * inv));
}

}  // namespace

// The entry points ops.h declares (decode_layers.cpp calls them directly).
namespace pagedllm_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [features] of the input's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t H = x.size(1);
  dispatch_float_types(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.const_data_ptr<T>();
    const T* wp = weight.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, x.size(0), grain_rows(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * stride, wp, op + r * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// Heads first .. first + count of each row of rows [T, width], each normalized over its head_dim
// by weight [head_dim] in place (Qwen3's q/k norms on the fused q/k/v rows): the same values as
// rms_norm over those heads as rows, with no copies.
void rms_norm_heads_(at::Tensor& rows, int64_t first, int64_t count, int64_t head_dim, const at::Tensor& weight,
                     double eps) {
  check_rows(rows, "rms_norm_heads_");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == head_dim && weight.scalar_type() == rows.scalar_type(),
              "rms_norm_heads_: weight must be [head_dim] of the rows' dtype");
  TORCH_CHECK(first >= 0 && count >= 0 && (first + count) * head_dim <= rows.size(1),
              "rms_norm_heads_: heads ", first, "..", first + count, " of ", head_dim, " past the rows' ", rows.size(1));
  dispatch_float_types(rows, "rms_norm_heads_", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* base = rows.mutable_data_ptr<T>() + first * head_dim;
    const T* wp = weight.const_data_ptr<T>();
    const int64_t stride = rows.stride(0);
    at::parallel_for(0, rows.size(0) * count, grain_rows(head_dim), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        T* head = base + (i / count) * stride + (i % count) * head_dim;
        norm_row(head, wp, head, head_dim, static_cast<float>(eps));
      }
    });
  });
}

// residual = round(residual + x); x = rms_norm(residual). In place on both.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.dim() == 2 && x.sizes() == residual.sizes(),
              "add_rms_norm_: x and residual must be contiguous [rows, features] of one shape");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm_: one dtype, weight [features]");
  const int64_t H = x.size(1);
  dispatch_float_types(x, "add_rms_norm_", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = x.mutable_data_ptr<T>();
    T* rp = residual.mutable_data_ptr<T>();
    const T* wp = weight.const_data_ptr<T>();
    at::parallel_for(0, x.size(0), grain_rows(H), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T* xr = xp + r * H;
        T* rr = rp + r * H;
        for (int64_t i = 0; i < H; ++i) store(rr + i, to_f32(rr[i]) + to_f32(xr[i]));
        norm_row(rr, wp, xr, H, static_cast<float>(eps));
      }
    });
  });
}

// out = round(round(silu(gate)) * up) for gate_up = [gate | up].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: an even number of features");
  const int64_t I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), I}, gate_up.options());
  dispatch_float_types(gate_up, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = gate_up.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, gate_up.size(0), grain_rows(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = gp + r * stride;
        const T* u = g + I;
        int64_t i = 0;
#ifdef __AVX2__
        // std::exp is a call per element that does not vectorize: a decode step's SiLU took longer
        // than its norms and rotary together.
        using namespace pagedllm_vec_avx2;
        for (; i + 8 <= I; i += 8) {
          const __m256 gv = load8(g + i);
          const __m256 silu = round8(g, _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                        exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
          store8(op + r * I + i, _mm256_mul_ps(silu, load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
          const float gv = to_f32(g[i]);
          store(op + r * I + i, round_to(g, gv / (1.0f + std::exp(-gv))) * to_f32(u[i]));
        }
      }
    });
  });
  return out;
}

// In place on the first num_heads heads of each row of qkv:
// x = round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1].
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rotary_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rotary_: cos and sin [T, head_dim] in the dtype of qkv");
  TORCH_CHECK(head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1), "rotary_: bad head layout");
  const int64_t half = head_dim / 2;
  dispatch_float_types(qkv, "rotary_", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* base = qkv.mutable_data_ptr<T>();
    const T* cp = cos.const_data_ptr<T>();
    const T* sp = sin.const_data_ptr<T>();
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, qkv.size(0), grain_rows(num_heads * head_dim), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* c = cp + r * head_dim;
        const T* s = sp + r * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          T* x = base + r * stride + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_f32(x[i]), x2 = to_f32(x[half + i]);
            const float a1 = round_to(x, x1 * to_f32(c[i])), b1 = round_to(x, -x2 * to_f32(s[i]));
            const float a2 = round_to(x, x2 * to_f32(c[half + i])), b2 = round_to(x, x1 * to_f32(s[half + i]));
            store(x + i, a1 + b1);
            store(x + half + i, a2 + b2);
          }
        }
      }
    });
  });
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm_heads_(Tensor(a!) rows, int first, int count, int head_dim, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("rms_norm", &pagedllm_ops::rms_norm);
  m.impl("add_rms_norm_", &pagedllm_ops::add_rms_norm_);
  m.impl("rms_norm_heads_", &pagedllm_ops::rms_norm_heads_);
  m.impl("silu_and_mul", &pagedllm_ops::silu_and_mul);
  m.impl("rotary_", &pagedllm_ops::rotary_);
}
