// Every decoder layer of a Llama-shaped model over a few rows (a decode step) in one call, running
// the same kernels in the same order as the Python layers do (so the result is bit for bit theirs)
// without going back to Python between them: in a one-stream decode of a small model, the ~10
// Python calls per layer (modules, checks, views, dispatch) cost about as much as the matmuls.
//
// The layers' weights come as two flat lists built once (pagedllm/model/decode_layers.py, which
// also says which models qualify): `tensors`, and `meta` describing them. Per layer:
//   meta:    sliding_window, then for each projection (qkv, o, gate_up, down): has_bias, has_lora,
//            num_parts, and per part: bits, group_size, rows
//   tensors: input norm weight, post-attention norm weight, key cache, value cache, key scales,
//            value scales (empty: an uncompressed cache), then for each projection: its float32
//            bias if it has one, its LoRA A, B and part columns if it has them (lora/layers.py: every
//            token's own adapter's update is added by lora_add_, over lora_slots), and per part:
//            codes, scales, mins, codebook (empty: none)
// after a header in meta: num_layers, num_heads, num_kv_heads, head_dim.
//
// Per layer, as model/llama.py's DecoderLayer with the compiled kernels: (add +) RMSNorm, the fused
// q/k/v projection, rotary in place on q and k, the K/V written to the paged cache, paged attention,
// the output projection, add + RMSNorm, gate/up, SiLU-and-mul, down. Returns [x, residual]: the last
// layer's MLP output and the residual stream (the final norm adds them, in Python).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace pagedllm_ops {
namespace {

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Reads the two flat lists in order.
struct Reader {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& meta;
  size_t next_tensor = 0, next_int = 0;

  const at::Tensor& tensor() {
    TORCH_CHECK(next_tensor < tensors.size(), "decode_layers: fewer tensors than meta describes");
    return tensors[next_tensor++];
  }
  int64_t integer() {
    TORCH_CHECK(next_int < meta.size(), "decode_layers: meta ends early");
    return meta[next_int++];
  }
};

// out = x @ W^T (+ bias) for a projection kept quantized in one or more parts (a fused q/k/v whose
// parts came in different layouts), each part writing its columns: model/quant_linear.py's _kernel.
at::Tensor project(const at::Tensor& x, Reader& r, const at::Tensor& lora_slots) {
  const bool has_bias = r.integer() != 0, has_lora = r.integer() != 0;
  const int64_t num_parts = r.integer();
  const std::optional<at::Tensor> bias = has_bias ? std::optional<at::Tensor>(r.tensor()) : std::nullopt;
  const at::Tensor* lora_a = has_lora ? &r.tensor() : nullptr;
  const at::Tensor* lora_b = has_lora ? &r.tensor() : nullptr;
  const at::Tensor* lora_cols = has_lora ? &r.tensor() : nullptr;
  const int64_t meta_start = static_cast<int64_t>(r.next_int);
  int64_t out_features = 0;
  for (int64_t i = 0; i < num_parts; ++i) out_features += r.meta[meta_start + 3 * i + 2];
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  int64_t start = 0;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t bits = r.integer(), group_size = r.integer(), rows = r.integer();
    const at::Tensor& codes = r.tensor();
    const at::Tensor& scales = r.tensor();
    const std::optional<at::Tensor> mins = present(r.tensor()), codebook = present(r.tensor());
    at::Tensor columns = num_parts == 1 ? out : out.narrow(1, start, rows);
    const std::optional<at::Tensor> part_bias =
        bias && num_parts > 1 ? std::optional<at::Tensor>(bias->narrow(0, start, rows)) : bias;
    quant_linear(x, codes, scales, mins, codebook, bits, group_size, part_bias, columns);
    start += rows;
  }
  if (has_lora) lora_add_(out, x, *lora_a, *lora_b, lora_slots, *lora_cols);
  return out;
}

std::vector<at::Tensor> decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& tensors,
                                      const std::vector<int64_t>& meta, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double eps,
                                      double scale, double softcap, bool use_amx, const at::Tensor& lora_slots) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x must be contiguous [T, hidden]");
  Reader r{tensors, meta};
  const int64_t num_layers = r.integer(), num_heads = r.integer(), num_kv_heads = r.integer(), head_dim = r.integer();
  const int64_t T = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in, residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t sliding_window = r.integer();
    const at::Tensor& input_norm = r.tensor();
    const at::Tensor& post_norm = r.tensor();
    at::Tensor key_cache = r.tensor(), value_cache = r.tensor();
    const std::optional<at::Tensor> key_scale = present(r.tensor()), value_scale = present(r.tensor());

    at::Tensor h;
    if (layer == 0) {  // the embeddings: the residual stream starts as them
      h = rms_norm(x, input_norm, eps);
      residual = x;
    } else {
      add_rms_norm_(x, residual, input_norm, eps);
      h = x;
    }
    at::Tensor qkv = project(h, r, lora_slots);
    rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    pagedllm_attention::write_kv(k, v, key_cache, value_cache, key_scale, value_scale, slot_mapping);
    const at::Tensor attended =
        pagedllm_attention::paged_attention(q, key_cache, value_cache, key_scale, value_scale, block_tables,
                                            seq_lens, query_start_loc, scale, sliding_window, softcap, use_amx);
    at::Tensor o = project(attended.view({T, q_size}), r, lora_slots);
    add_rms_norm_(o, residual, post_norm, eps);
    const at::Tensor gate_up = project(o, r, lora_slots);
    x = project(silu_and_mul(gate_up), r, lora_slots);
  }
  TORCH_CHECK(r.next_tensor == tensors.size() && r.next_int == meta.size(),
              "decode_layers: tensors or meta left over: they do not describe the layers");
  return {x, residual};
}

}  // namespace
}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("decode_layers(Tensor x, Tensor(a!)[] tensors, int[] meta, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float eps, float scale, float softcap, "
        "bool use_amx, Tensor lora_slots) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("decode_layers", &pagedllm_ops::decode_layers); }
