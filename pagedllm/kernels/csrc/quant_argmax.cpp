// A quantized projection's greedy choice in one call: quant_linear's output (the same kernel, so
// the same values), then each row's first maximal column, as torch's max(-1).indices gives it (NaN
// counts as the largest). A one-stream decode step's LM head took a second torch call for the
// maximum, whose set-up costs more than its 49k comparisons once the weights' stream has pushed it
// out of cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "ops.h"

namespace {

constexpr int64_t kInterleavedRows = 16;  // quant_weight.INTERLEAVED_ROWS

template <typename T>
int64_t first_maximum(const T* row, int64_t n) {
  float best = -INFINITY;
  bool nan = false;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    nan |= v != v;
    best = v > best ? v : best;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;  // every value -inf (equal to best) is found above; only n == 0 gets here
}

}  // namespace

namespace pagedllm_ops {

at::Tensor quant_linear_argmax(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook,
                               int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_argmax: x must be float32 or bfloat16 [M, K]");
  const int64_t N = qweight.dim() == 3 ? qweight.size(0) * kInterleavedRows : qweight.size(0);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  quant_linear(x, qweight, scales, mins, codebook, bits, group_size, bias, out);
  at::Tensor index = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* ip = index.mutable_data_ptr<int64_t>();
  auto rows = [&](const auto* op) {
    at::parallel_for(0, x.size(0), 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) ip[m] = first_maximum(op + m * N, N);
    });
  };
  if (x.scalar_type() == at::kFloat) rows(out.const_data_ptr<float>());
  else rows(out.const_data_ptr<c10::BFloat16>());
  return index;
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_linear_argmax(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("quant_linear_argmax", &pagedllm_ops::quant_linear_argmax); }
