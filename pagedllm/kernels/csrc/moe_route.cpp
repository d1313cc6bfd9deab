// A mixture of experts' router for a few rows (model/moe.py, greedy softmax routing: Qwen3-MoE,
// Mixtral): the router's logits in fp32, a softmax over every expert, the top k, renormalized where
// the model says, times its scale, rounded to the activations' dtype. One call instead of the ten
// torch operations of moe.route (each a few microseconds, which in a one-stream decode of a small
// MoE cost as much as the router's arithmetic); both the layers' path and a decode step's one call
// (decode_layers.cpp) take it, so they agree bit for bit. Plain C++ every tier builds.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

template <typename T, typename W>
void route_rows(const T* x, int64_t ldx, const W* router, int64_t experts, int64_t hidden, int64_t top_k,
                bool normalize, float scale, T* weights, int64_t* picked, int64_t r0, int64_t r1) {
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  for (int64_t t = r0; t < r1; ++t) {
    const T* row = x + t * ldx;
    float top = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) {
      const W* w = router + e * hidden;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t h = 0; h < hidden; ++h) sum += static_cast<float>(row[h]) * static_cast<float>(w[h]);
      probs[e] = sum;
      top = std::max(top, sum);
    }
    float total = 0.0f;
    for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(probs[e] - top);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    // The k most probable, the lower index first among equals.
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    float chosen = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) chosen += probs[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      const float p = probs[order[j]];
      weights[t * top_k + j] = static_cast<T>((normalize ? p / (chosen + 1e-20f) : p) * scale);
      picked[t * top_k + j] = order[j];
    }
  }
}

}  // namespace

namespace pagedllm_ops {

// (weights [T, k] of x's dtype, expert ids [T, k] int64) for x [T, hidden] and router [E, hidden].
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool normalize, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_route: x must be float32 or bfloat16 [T, hidden] with contiguous rows");
  TORCH_CHECK(router.dim() == 2 && router.is_contiguous() && router.size(1) == x.size(1) &&
                  (router.scalar_type() == at::kFloat || router.scalar_type() == at::kBFloat16),
              "moe_route: the router must be a contiguous float32 or bfloat16 [experts, hidden]");
  const int64_t T = x.size(0), E = router.size(0), H = x.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k must be in [1, ", E, "], got ", top_k);
  at::Tensor weights = at::empty({T, top_k}, x.options());
  at::Tensor picked = at::empty({T, top_k}, x.options().dtype(at::kLong));
  auto run = [&](auto* x_tag, auto* w_tag) {
    using T_ = std::remove_pointer_t<decltype(x_tag)>;
    using W_ = std::remove_pointer_t<decltype(w_tag)>;
    const T_* xp = x.const_data_ptr<T_>();
    const W_* rp = router.const_data_ptr<W_>();
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(E * H / 1024, 1)), [&](int64_t r0, int64_t r1) {
      route_rows(xp, x.stride(0), rp, E, H, top_k, normalize, static_cast<float>(scale),
                 weights.mutable_data_ptr<T_>(), picked.mutable_data_ptr<int64_t>(), r0, r1);
    });
  };
  const bool x_f32 = x.scalar_type() == at::kFloat, r_f32 = router.scalar_type() == at::kFloat;
  if (x_f32 && r_f32) run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (x_f32) run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  else if (r_f32) run(static_cast<c10::BFloat16*>(nullptr), static_cast<float*>(nullptr));
  else run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  return {weights, picked};
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("moe_route(Tensor x, Tensor router, int top_k, bool normalize, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("moe_route", &pagedllm_ops::moe_route); }
