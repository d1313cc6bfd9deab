// The quantized weights' layout (quant_matmul.cpp describes it) as the generic kernels read it
// (generic_quant.cpp, quant_int8_avx2.cpp): pointers, sizes and the checks of the tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>

namespace pagedllm_generic {
namespace {

struct Layout {
  const uint8_t* codes;
  int64_t row_bytes, N, K, G;
  const void* scales;
  const void* mins;  // nullptr: none
  bool half;         // scales (and mins) are float16, else float32
  const float* book; // 4-bit only
  int bits;

  float group_value(const void* p, int64_t n, int64_t g) const {
    const int64_t i = n * (K / G) + g;
    return half ? static_cast<float>(static_cast<const c10::Half*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  float scale(int64_t n, int64_t g) const { return group_value(scales, n, g); }
  float min(int64_t n, int64_t g) const { return mins ? group_value(mins, n, g) : 0.0f; }
};

Layout make_layout(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                   const std::optional<at::Tensor>& codebook, int64_t bits, int64_t G) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && q.element_size() == 1,
              "quantized weights: codes must be [N, bytes] uint8/int8 with contiguous rows");
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (bits == 8 ? G % 16 == 0 : (G == 16 || G % 32 == 0)),
              "quantized weights: group size must divide K (a multiple of 16; 4-bit: 16 or 32k)");
  auto check_groups = [&](const at::Tensor& s, const char* name) {
    TORCH_CHECK(s.scalar_type() == scales.scalar_type() && (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat) &&
                    s.dim() == 2 && s.size(0) == N && s.size(1) == K / G && s.is_contiguous(),
                "quantized weights: ", name, " must be float16 or float32 [N, K / group_size]");
  };
  check_groups(scales, "scales");
  if (mins) check_groups(*mins, "mins");
  TORCH_CHECK(bits == 8 || (codebook && codebook->scalar_type() == at::kFloat && codebook->is_contiguous() &&
                            codebook->numel() == 16),
              "quantized weights: 4-bit codes need a contiguous float32 codebook of 16 values");
  return Layout{static_cast<const uint8_t*>(q.data_ptr()), q.stride(0), N, K, G, scales.data_ptr(),
                mins ? mins->data_ptr() : nullptr, scales.scalar_type() == at::kHalf,
                bits == 4 ? codebook->const_data_ptr<float>() : nullptr, static_cast<int>(bits)};
}

}  // namespace
}  // namespace pagedllm_generic
