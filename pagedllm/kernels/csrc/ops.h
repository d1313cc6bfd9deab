// The entry points of every compiled tier's kernels that other kernels call directly
// (decode_layers.cpp runs a whole decode step's layers through them, decode_burst.cpp several
// steps), declared once. Each is also a torch op of the tier (registered beside its definition)
// with the same arguments. Where a tier defines them is named per group (AVX-512 source; AVX2
// source).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace pagedllm_ops {

// A tensor of the flat lists Python packs (decode_layers.cpp, decode_burst.cpp): an empty one
// marks an absent optional tensor.
inline std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

// fused_ops.cpp; generic_fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rms_norm_heads_(at::Tensor& rows, int64_t first, int64_t count, int64_t head_dim, const at::Tensor& weight,
                     double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t head_dim);

// quant_matmul.cpp; generic_quant.cpp
void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                  int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out);
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                            at::ScalarType dtype);

// quant_embedding.cpp (both)
at::Tensor quant_embedding(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                           const at::Tensor& ids, at::ScalarType dtype);

// quant_argmax.cpp (both)
at::Tensor quant_linear_argmax(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook,
                               int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias);

// decode_layers.cpp (both)
at::Tensor decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& meta, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, double eps, double scale, double softcap, bool use_amx,
                         const at::Tensor& lora_slots);

// moe_route.cpp (both)
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router, int64_t top_k,
                                             bool normalize, double scale);

// lora.cpp (both)
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots,
               const at::Tensor& part_cols);

}  // namespace pagedllm_ops

namespace pagedllm_attention {

// attention_entry.cpp (both), its kernel in paged_attention.cpp; attention_avx2.cpp
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                           double softcap, bool use_amx);
at::Tensor paged_attention_invariant(const at::Tensor& query, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const std::optional<at::Tensor>& key_scale,
                                     const std::optional<at::Tensor>& value_scale, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                     int64_t sliding_window, double softcap);
bool attention_amx_available();

// write_kv.cpp (both)
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
              const at::Tensor& slot_mapping);
void touch_blocks(const std::vector<at::Tensor>& caches, const at::Tensor& block_ids);

}  // namespace pagedllm_attention
