// The paged attention ops' entry points, shared by every tier: the call's tensors checked and read
// into a Problem (attention_plan.h), then the tier's run_problem. The layout and the kernels are
// described in paged_attention.cpp.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "attention_plan.h"
#include "dispatch.h"
#include "ops.h"

namespace pagedllm_attention {
namespace {

at::Tensor attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, double softcap, bool use_amx, bool row_invariant) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention: query [T, Hq, D], caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "paged_attention: contiguous caches, query rows of contiguous heads");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "paged_attention: caches must share a dtype");
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value() &&
                  key_scale.has_value() == (key_cache.scalar_type() != query.scalar_type()),
              "paged_attention: scales for both caches when they are compressed, else none");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_attention: int32 metadata");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim, "paged_attention: query and cache head_dim differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv heads");
  check_scale(key_scale, key_cache, "paged_attention");
  check_scale(value_scale, value_cache, "paged_attention");
  const c10::Half* ks = key_scale.has_value() ? key_scale->const_data_ptr<c10::Half>() : nullptr;
  const c10::Half* vs = value_scale.has_value() ? value_scale->const_data_ptr<c10::Half>() : nullptr;
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const int64_t num_seqs = lens.size(0);
  if (num_seqs == 0 || query.size(0) == 0) return out;

  auto run_with = [&](auto* query_tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(query_tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    Problem<T, C> p{query.const_data_ptr<T>(), key_cache.const_data_ptr<C>(), value_cache.const_data_ptr<C>(), ks, vs,
                    out.mutable_data_ptr<T>(), tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(),
                    starts.const_data_ptr<int32_t>(), query.stride(0), tables.dim() == 2 ? tables.size(1) : 0,
                    key_cache.size(1), query.size(1), key_cache.size(2), head_dim, sliding_window,
                    static_cast<float>(scale), static_cast<float>(softcap), row_invariant};
    run_problem(p, num_seqs, use_amx);
  };
  dispatch_model_dtype(query.scalar_type(), "paged_attention", [&](auto* query_tag) {
    if (key_cache.scalar_type() == query.scalar_type()) {
      run_with(query_tag, query_tag);
    } else {
      dispatch_code_dtype(key_cache.scalar_type(), "paged_attention",
                          [&](auto* cache_tag) { run_with(query_tag, cache_tag); });
    }
  });
  return out;
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                           double softcap, bool use_amx) {
  return attention(query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens, query_start_loc,
                   scale, sliding_window, softcap, use_amx, false);
}

// paged_attention in batch-invariant mode (Problem::row_invariant): a row's result depends on its
// request's context only, not on the batch.
at::Tensor paged_attention_invariant(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const std::optional<at::Tensor>& key_scale,
                                     const std::optional<at::Tensor>& value_scale, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                     int64_t sliding_window, double softcap) {
  return attention(query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens, query_start_loc,
                   scale, sliding_window, softcap, false, true);
}

}  // namespace pagedllm_attention
