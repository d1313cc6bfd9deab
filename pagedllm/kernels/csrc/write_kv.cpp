// Writes into the paged KV cache: each new token's K/V row at its slot, quantized (with its fp16
// scale) where the cache is compressed, exactly as pagedllm.kernels.attention.kv_quant does; and the
// parallel first touch of a step's new blocks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "dispatch.h"

namespace pagedllm_attention {
namespace {

// A code's largest magnitude, and x (already divided by the scale) as a code: int8 rounds half
// to even and clamps; fp8 clamps to its largest finite value and rounds to nearest even.
inline float max_code(const int8_t*) { return 127.0f; }
template <typename F8>
float max_code(const F8*) { return static_cast<float>(std::numeric_limits<F8>::max()); }

inline int8_t to_code(float x, const int8_t* tag) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(x), -max_code(tag), max_code(tag)));
}
template <typename F8>
F8 to_code(float x, const F8* tag) { return F8(std::clamp(x, -max_code(tag), max_code(tag))); }

// One token's head x[0..n) as codes and their fp16 scale, exactly as kv_quant.quantize does:
// scale = max |x| / max_code rounded up to fp16, code = x / scale (the stored scale) as a code.
template <typename T, typename C>
void quantize_row(const T* x, C* codes, c10::Half* scale, int64_t n) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[i])));
  const float exact = absmax / max_code(codes);
  c10::Half stored = exact;
  if (static_cast<float>(stored) < exact) stored = c10::Half(stored.x + 1, c10::Half::from_bits());  // next up
  *scale = stored;
  const float s = static_cast<float>(stored);
  for (int64_t i = 0; i < n; ++i) codes[i] = s > 0.0f ? to_code(static_cast<float>(x[i]) / s, codes) : C(0);
}

}  // namespace

// key_cache/value_cache viewed as [slots, Hkv * D]: row slot_mapping[t] = key[t] / value[t]. Each
// token's K and V are one contiguous row wherever they sit (e.g. views into the fused q/k/v rows).
// A compressed cache gets each token's heads quantized, with their scales.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "write_kv: key/value [T, Hkv, D] with each token's heads contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2) &&
                  key_cache.sizes() == value_cache.sizes(),
              "write_kv: caches [blocks, block_size, Hkv, D] matching key/value");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv: key and value share a dtype, and so do the caches");
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), "write_kv: scales for both caches or neither");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0),
              "write_kv: int64 slot_mapping, one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " out of range");
  }
  if (key.scalar_type() == key_cache.scalar_type()) {  // the model's dtype: copy the rows
    TORCH_CHECK(!key_scale.has_value(), "write_kv: scales belong to compressed caches");
    const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
    const char* kp = static_cast<const char*>(key.const_data_ptr());
    const char* vp = static_cast<const char*>(value.const_data_ptr());
    char* kc = static_cast<char*>(key_cache.mutable_data_ptr());
    char* vc = static_cast<char*>(value_cache.mutable_data_ptr());
    const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
    // From 16 rows on, both cores: each row's lines are write-allocated from DRAM (fresh slots).
    at::parallel_for(0, key.size(0), 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        std::memcpy(kc + sp[t] * row_bytes, kp + t * ks, row_bytes);
        std::memcpy(vc + sp[t] * row_bytes, vp + t * vs, row_bytes);
      }
    });
    return;
  }
  TORCH_CHECK(key_scale.has_value(), "write_kv: a compressed cache needs its scales");
  check_scale(key_scale, key_cache, "write_kv");
  check_scale(value_scale, value_cache, "write_kv");
  c10::Half* kscale = key_scale->mutable_data_ptr<c10::Half>();
  c10::Half* vscale = value_scale->mutable_data_ptr<c10::Half>();
  const int64_t heads = key.size(1), head_dim = key.size(2);
  dispatch_model_dtype(key.scalar_type(), "write_kv", [&](auto* key_tag) {
    using T = std::remove_pointer_t<decltype(key_tag)>;
    dispatch_code_dtype(key_cache.scalar_type(), "write_kv", [&](auto* cache_tag) {
      using C = std::remove_pointer_t<decltype(cache_tag)>;
      const T* kp = key.const_data_ptr<T>();
      const T* vp = value.const_data_ptr<T>();
      C* kc = key_cache.mutable_data_ptr<C>();
      C* vc = value_cache.mutable_data_ptr<C>();
      at::parallel_for(0, key.size(0), 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t row = sp[t] * heads + h;  // (slot, head) in the cache
            quantize_row(kp + t * key.stride(0) + h * head_dim, kc + row * head_dim, kscale + row, head_dim);
            quantize_row(vp + t * value.stride(0) + h * head_dim, vc + row * head_dim, vscale + row, head_dim);
          }
        }
      });
    });
  });
}

// Brings every page of the listed blocks of each cache tensor (dim 0: blocks, contiguous) into
// the process, keeping what they hold (a byte per page gets 0 added). Faulting a
// step's new blocks in here, in one parallel pass, costs a fraction of what the same faults cost
// one at a time inside the model's parallel kernels (where a fault on one core stalls both).
void touch_blocks(const std::vector<at::Tensor>& caches, const at::Tensor& block_ids) {
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "touch_blocks: block_ids must be a contiguous int64 vector");
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() && cache.dim() >= 1,
                "touch_blocks: each cache must be a contiguous CPU tensor of blocks");
  }
  const int64_t* ids = block_ids.const_data_ptr<int64_t>();
  const int64_t num_ids = block_ids.numel();
  for (int64_t i = 0; i < num_ids; ++i) {
    for (const at::Tensor& cache : caches) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < cache.size(0), "touch_blocks: block ", ids[i], " out of range");
    }
  }
  constexpr uintptr_t kPage = 4096;
  const int64_t num_caches = static_cast<int64_t>(caches.size());
  at::parallel_for(0, num_caches * num_ids, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const at::Tensor& cache = caches[w / num_ids];
      const int64_t row_bytes = cache.stride(0) * static_cast<int64_t>(cache.element_size());
      char* first = static_cast<char*>(cache.data_ptr()) + ids[w % num_ids] * row_bytes;
      const uintptr_t last = reinterpret_cast<uintptr_t>(first) + row_bytes;
      for (uintptr_t page = reinterpret_cast<uintptr_t>(first) & ~(kPage - 1); page < last; page += kPage) {
        // An atomic add of 0 is one write access: one fault per page, where a read then a write
        // would map the zero page first and fault again to replace it.
        __atomic_fetch_add(reinterpret_cast<char*>(std::max(page, reinterpret_cast<uintptr_t>(first))), 0,
                           __ATOMIC_RELAXED);
      }
    }
  });
}

}  // namespace pagedllm_attention
