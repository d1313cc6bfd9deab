// Every decoder layer of a Llama-shaped model over a step's rows (a decode step; where the int8
// kernel takes any number of rows, a prefill chunk too: model/decode_layers.py) in one call, running
// the same kernels in the same order as the Python layers do (so the result is bit for bit theirs)
// without going back to Python between them: in a one-stream decode of a small model, the ~10
// Python calls per layer (modules, checks, views, dispatch) cost about as much as the matmuls.
//
// The layers' weights come as two flat lists built once (pagedllm/model/decode_layers.py, which
// also says which models qualify): `tensors`, and `meta` describing them. Per layer:
//   meta:    sliding_window, has_qk_norm, num_experts (0: a dense MLP), and for a mixture of
//            experts top_k, normalize and has_gated_shared_expert; then for each projection (qkv, o,
//            then gate_up and down, or each expert's gate_up and down and the shared expert's):
//            has_bias, has_lora, num_parts, and per part: bits, group_size, rows
//   tensors: input norm weight, post-attention norm weight, key cache, value cache, key scales,
//            value scales (empty: an uncompressed cache), the q and k norms' weights if it has them,
//            the q/k/v and output projections, then gate_up and down, or the router's weight, its
//            scale (float64 [1]), the shared expert's gate weight [1, hidden] if it has one, each
//            expert's gate_up and down, and the shared expert's. A projection: its float32 bias
//            if it has one, its LoRA A, B and part columns if it has them (lora/layers.py: every
//            token's own adapter's update is added by lora_add_, over lora_slots), and per part:
//            codes, scales, mins, codebook (empty: none)
// after a header in meta: num_layers, num_heads, num_kv_heads, head_dim; and after the layers'
// tensors, the final norm's weight.
//
// Per layer, as model/llama.py's DecoderLayer with the compiled kernels: (add +) RMSNorm, the fused
// q/k/v projection (Qwen3: each head of q and k normalized in place), rotary in place on q and k,
// the K/V written to the paged cache, paged attention, the output projection, add + RMSNorm, then
// gate/up, SiLU-and-mul, down; or a mixture of experts as model/moe.py's SparseMoE runs it (the
// compiled router, each expert once over its tokens, the same torch operations in the same order
// around them; Qwen2-MoE's shared expert scaled by its sigmoid gate and added, as shared_output).
// Then the final norm, as the model's (add + RMSNorm): returns the hidden states.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"

namespace pagedllm_ops {
namespace {

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

// One part of a projection kept quantized (a fused q/k/v whose parts came in different layouts).
struct Part {
  int64_t bits, group_size, rows;
  const at::Tensor *codes, *scales;
  std::optional<at::Tensor> mins, codebook;
};

// A projection as the lists describe it: read once, applied any number of times (an expert's
// projections are read whether or not a step's tokens pick it).
struct Projection {
  std::optional<at::Tensor> bias;
  const at::Tensor *lora_a = nullptr, *lora_b = nullptr, *lora_cols = nullptr;
  std::vector<Part> parts;
  int64_t out_features = 0;

  explicit Projection(Reader& r) {
    const bool has_bias = r.integer() != 0, has_lora = r.integer() != 0;
    const int64_t num_parts = r.integer();
    if (has_bias) bias = r.tensor();
    if (has_lora) {
      lora_a = &r.tensor();
      lora_b = &r.tensor();
      lora_cols = &r.tensor();
    }
    for (int64_t i = 0; i < num_parts; ++i) {
      Part part{r.integer(), r.integer(), r.integer(), nullptr, nullptr, std::nullopt, std::nullopt};
      part.codes = &r.tensor();
      part.scales = &r.tensor();
      part.mins = present(r.tensor());
      part.codebook = present(r.tensor());
      out_features += part.rows;
      parts.push_back(std::move(part));
    }
  }

  // out = x @ W^T (+ bias), each part writing its columns: model/quant_linear.py's _kernel.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& lora_slots) const {
    at::Tensor out = at::empty({x.size(0), out_features}, x.options());
    const int64_t num_parts = static_cast<int64_t>(parts.size());
    int64_t start = 0;
    for (const Part& part : parts) {
      at::Tensor columns = num_parts == 1 ? out : out.narrow(1, start, part.rows);
      const std::optional<at::Tensor> part_bias =
          bias && num_parts > 1 ? std::optional<at::Tensor>(bias->narrow(0, start, part.rows)) : bias;
      quant_linear(x, *part.codes, *part.scales, part.mins, part.codebook, part.bits, part.group_size, part_bias,
                   columns);
      start += part.rows;
    }
    if (lora_a != nullptr) lora_add_(out, x, *lora_a, *lora_b, lora_slots, *lora_cols);
    return out;
  }
};

// A gated SiLU MLP: down(silu_and_mul(gate_up(x))), as model/llama.py's MLP with the compiled kernels.
struct GatedMLP {
  Projection gate_up, down;
  explicit GatedMLP(Reader& r) : gate_up(r), down(r) {}
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& lora_slots) const {
    return down(silu_and_mul(gate_up(x, lora_slots)), lora_slots);
  }
};

// The rows of x [tokens, H] an expert takes, one per (token, pick) pair of it (pair / top_k is its
// token): x itself where that is every token in order (a one-token step's), else copied.
at::Tensor expert_rows(const at::Tensor& x, const std::vector<int64_t>& pairs, int64_t top_k) {
  TORCH_CHECK(x.is_contiguous(), "decode_layers: the experts' input must be contiguous");
  const int64_t n = static_cast<int64_t>(pairs.size()), tokens = x.size(0);
  bool all_in_order = n == tokens;
  for (int64_t i = 0; i < n && all_in_order; ++i) all_in_order = pairs[i] / top_k == i;
  if (all_in_order) return x;
  at::Tensor rows = at::empty({n, x.size(1)}, x.options());
  const size_t row_bytes = x.size(1) * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(rows.mutable_data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, src + (pairs[i] / top_k) * row_bytes, row_bytes);
  return rows;
}

// model/moe.py's SparseMoE.forward with greedy softmax routing, and no shared expert or a gated one
// (Qwen2-MoE): the compiled router (moe_route.cpp), then the same torch operations in the same
// order, each expert's MLP by the compiled kernels.
at::Tensor mixture(const at::Tensor& x, Reader& r, int64_t num_experts, int64_t top_k, bool normalize,
                   bool gated_shared, const at::Tensor& lora_slots) {
  const at::Tensor& router = r.tensor();
  const double scale = *r.tensor().const_data_ptr<double>();  // float64 [1], read without a torch call
  const at::Tensor* shared_gate = gated_shared ? &r.tensor() : nullptr;
  std::vector<GatedMLP> experts;
  experts.reserve(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) experts.emplace_back(r);
  std::optional<GatedMLP> shared;
  if (gated_shared) shared.emplace(r);
  const auto [weights, picked] = moe_route(x, router, top_k, normalize, scale);
  // run_experts(): each expert once over its tokens; each (token, pick) pair's output times its
  // weight, rounded, in a row of its own; a token's k rows summed in fp32 in pick order and rounded
  // once, as torch's sum over that dim does. The same values as moe.py's torch operations (the
  // pairs' order within an expert is argsort's stable one), without their ~15 calls a layer.
  const int64_t tokens = x.size(0), H = x.size(-1);
  std::vector<std::vector<int64_t>> pairs_of(num_experts);
  const int64_t* pick = picked.const_data_ptr<int64_t>();
  for (int64_t pair = 0; pair < tokens * top_k; ++pair) pairs_of[pick[pair]].push_back(pair);
  at::Tensor pair_out = at::empty({tokens * top_k, H}, x.options());
  at::Tensor out = at::empty({tokens, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "mixture", [&] {
    const scalar_t* w = weights.const_data_ptr<scalar_t>();
    scalar_t* po = pair_out.mutable_data_ptr<scalar_t>();
    for (int64_t e = 0; e < num_experts; ++e) {
      const std::vector<int64_t>& pairs = pairs_of[e];
      if (pairs.empty()) continue;
      const at::Tensor expert_out = experts[e](expert_rows(x, pairs, top_k), lora_slots).contiguous();
      const scalar_t* eo = expert_out.const_data_ptr<scalar_t>();
      for (size_t i = 0; i < pairs.size(); ++i) {
        const float weight = static_cast<float>(w[pairs[i]]);
        scalar_t* dst = po + pairs[i] * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<scalar_t>(static_cast<float>(eo[i * H + h]) * weight);
      }
    }
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float sum = 0.0f;
        for (int64_t j = 0; j < top_k; ++j) sum += static_cast<float>(po[(t * top_k + j) * H + h]);
        o[t * H + h] = static_cast<scalar_t>(sum);
      }
  });
  if (!shared) return out;
  // SparseMoE.shared_output: the gate's one logit per token in float32 (moe.py's Router), its
  // sigmoid rounded to x's dtype, times the shared expert's output; then added to the experts'.
  const at::Tensor gate = at::linear(x.to(at::kFloat), shared_gate->to(at::kFloat));
  return out + at::sigmoid(gate).to(x.scalar_type()) * (*shared)(x, lora_slots);
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& tensors,
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
    const bool qk_norm = r.integer() != 0;
    const int64_t num_experts = r.integer();
    const int64_t top_k = num_experts > 0 ? r.integer() : 0;
    const bool normalize = num_experts > 0 && r.integer() != 0;
    const bool gated_shared = num_experts > 0 && r.integer() != 0;
    const at::Tensor& input_norm = r.tensor();
    const at::Tensor& post_norm = r.tensor();
    at::Tensor key_cache = r.tensor(), value_cache = r.tensor();
    const std::optional<at::Tensor> key_scale = present(r.tensor()), value_scale = present(r.tensor());
    const at::Tensor* q_norm = qk_norm ? &r.tensor() : nullptr;
    const at::Tensor* k_norm = qk_norm ? &r.tensor() : nullptr;

    at::Tensor h;
    if (layer == 0) {  // the embeddings: the residual stream starts as them
      h = rms_norm(x, input_norm, eps);
      residual = x;
    } else {
      add_rms_norm_(x, residual, input_norm, eps);
      h = x;
    }
    at::Tensor qkv = Projection(r)(h, lora_slots);
    if (qk_norm) {  // Qwen3's q/k norms on each head, in place, as model/llama.py's Attention does
      rms_norm_heads_(qkv, 0, num_heads, head_dim, *q_norm, eps);
      rms_norm_heads_(qkv, num_heads, num_kv_heads, head_dim, *k_norm, eps);
    }
    rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    pagedllm_attention::write_kv(k, v, key_cache, value_cache, key_scale, value_scale, slot_mapping);
    const at::Tensor attended =
        pagedllm_attention::paged_attention(q, key_cache, value_cache, key_scale, value_scale, block_tables,
                                            seq_lens, query_start_loc, scale, sliding_window, softcap, use_amx);
    at::Tensor o = Projection(r)(attended.view({T, q_size}), lora_slots);
    add_rms_norm_(o, residual, post_norm, eps);
    x = num_experts > 0 ? mixture(o, r, num_experts, top_k, normalize, gated_shared, lora_slots)
                        : GatedMLP(r)(o, lora_slots);
  }
  add_rms_norm_(x, residual, r.tensor(), eps);  // the model's final norm
  TORCH_CHECK(r.next_tensor == tensors.size() && r.next_int == meta.size(),
              "decode_layers: tensors or meta left over: they do not describe the layers");
  return x;
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("decode_layers(Tensor x, Tensor(a!)[] tensors, int[] meta, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float eps, float scale, float softcap, "
        "bool use_amx, Tensor lora_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("decode_layers", &pagedllm_ops::decode_layers); }
