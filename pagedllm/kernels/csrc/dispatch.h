// The one dtype dispatch of the attention kernels (the query's dtype; a compressed cache's codes)
// and the check of a compressed cache's scales, shared by paged_attention.cpp and write_kv.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <optional>

namespace pagedllm_attention {

// Calls f(tag) with a null pointer of the C++ type for a float32 or bfloat16 tensor's dtype.
template <typename F>
void dispatch_model_dtype(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (dtype == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, what, ": float32 or bfloat16 only");
  }
}

// The same for a compressed cache's codes: int8, fp8 e4m3 or fp8 e5m2.
template <typename F>
void dispatch_code_dtype(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kChar) {
    f(static_cast<int8_t*>(nullptr));
  } else if (dtype == at::kFloat8_e4m3fn) {
    f(static_cast<c10::Float8_e4m3fn*>(nullptr));
  } else if (dtype == at::kFloat8_e5m2) {
    f(static_cast<c10::Float8_e5m2*>(nullptr));
  } else {
    TORCH_CHECK(false, what, ": the cache holds the query's dtype, int8, float8_e4m3fn or float8_e5m2");
  }
}

// Optional per-token-and-head scales of a cache: fp16 [blocks, block_size, Hkv], contiguous.
inline void check_scale(const std::optional<at::Tensor>& scale, const at::Tensor& cache, const char* what) {
  TORCH_CHECK(!scale.has_value() || (scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                                     scale->dim() == 3 && scale->size(0) == cache.size(0) &&
                                     scale->size(1) == cache.size(1) && scale->size(2) == cache.size(2)),
              what, ": scales are float16 [blocks, block_size, Hkv], contiguous");
}

}  // namespace pagedllm_attention
