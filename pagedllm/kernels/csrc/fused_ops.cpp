// Elementwise fusions around a Llama layer's matmuls, each one pass over memory where the torch
// path makes several: RMSNorm (with the residual add folded in), rotary embedding in place on the
// fused q/k/v rows, and SiLU(gate) * up. Results are rounded to the storage dtype wherever the
// torch path rounds, so they agree with it up to the order of one fp32 sum.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"
#include "vec.h"

namespace {

using namespace pagedllm_vec;

// Below this much work a call stays on one thread: a parallel region costs tens of microseconds
// when the other threads sleep (OMP_WAIT_POLICY=PASSIVE) or are busy, more than a decode step's
// elementwise work (64 rows x 1536 take ~60 us on one thread).
constexpr int64_t kGrainElements = 1 << 14;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1)); }

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

// out = weight * round(x / rms(x)), rounded; the torch path: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(T)
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t H, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = load_f32(x + i, tail_mask(H - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(H) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    const __m512 normed = round_to(x, _mm512_mul_ps(load_f32(x + i, m), vinv));
    store_f32(out + i, _mm512_mul_ps(load_f32(w + i, m), normed), m);
  }
}

}  // namespace

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
        for (int64_t i = 0; i < H; i += 16) {
          const __mmask16 m = tail_mask(H - i);
          store_f32(rr + i, _mm512_add_ps(load_f32(rr + i, m), load_f32(xr + i, m)), m);
        }
        norm_row(rr, wp, xr, H, static_cast<float>(eps));
      }
    });
  });
}

// out = round(round(silu(gate)) * up) for gate_up = [gate | up]; the torch path: F.silu(gate) * up.
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
    const __m512 one = _mm512_set1_ps(1.0f);
    at::parallel_for(0, gate_up.size(0), grain_rows(I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = gp + r * stride;
        const T* u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
          const __mmask16 m = tail_mask(I - i);
          const __m512 gv = load_f32(g + i, m);
          const __m512 silu = round_to(g, _mm512_div_ps(gv, _mm512_add_ps(one, exp_f32(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
          store_f32(op + r * I + i, _mm512_mul_ps(silu, load_f32(u + i, m)), m);
        }
      }
    });
  });
  return out;
}

// In place on the first num_heads heads of each row of qkv ([T, >= num_heads * head_dim]):
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
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 c1 = load_f32(c + i, m), c2 = load_f32(c + half + i, m);
          const __m512 s1 = load_f32(s + i, m), s2 = load_f32(s + half + i, m);
          for (int64_t h = 0; h < num_heads; ++h) {
            T* x = base + r * stride + h * head_dim;
            const __m512 x1 = load_f32(x + i, m), x2 = load_f32(x + half + i, m);
            const __m512 a1 = round_to(x, _mm512_mul_ps(x1, c1));
            const __m512 b1 = round_to(x, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1));
            const __m512 a2 = round_to(x, _mm512_mul_ps(x2, c2));
            const __m512 b2 = round_to(x, _mm512_mul_ps(x1, s2));
            store_f32(x + i, _mm512_add_ps(a1, b1), m);
            store_f32(x + half + i, _mm512_add_ps(a2, b2), m);
          }
        }
      }
    });
  });
}

}  // namespace pagedllm_ops

using namespace pagedllm_ops;

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm_heads_(Tensor(a!) rows, int first, int count, int head_dim, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rms_norm_heads_", &rms_norm_heads_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
}
