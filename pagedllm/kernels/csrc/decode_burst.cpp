// A decode burst (pagedllm/engine/decode_burst.py) in one call: up to a few greedy sequences each
// make `counts[i]` tokens by that many decode steps one after another, each step's argmax the next
// step's input, without going back to Python between the steps. Each step is the one
// worker/runner.py's run_burst takes in Python, with the same calls in the same order (so the
// tokens are bit for bit its): the embeddings of the sequences still going (the quantized table's
// quant_embedding, or a plain table's embedding), their rotary cos/sin as model/rope.py computes
// them, every layer and the final norm in decode_layers, then the quantized LM head's argmax
// (quant_linear_argmax). In a burst of one stream that Python was ~8% of a token's time.
//
// The burst's rows come as a prepared step lays them out: sequence i's `counts[i]` slots one after
// another in slot_mapping, its first at position context[i] (its tokens before the burst). The
// embedding table comes as [weight] (plain) or [codes, scales, mins, codebook] (quantized; empty:
// none); the head as [codes, scales, mins, codebook, bias]. Returns int64 [n, max count]: each
// sequence's tokens, -1 past its count.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

at::Tensor longs(const std::vector<int64_t>& values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong));
}

at::Tensor ints(const std::vector<int64_t>& values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(at::kInt);
}

}  // namespace

namespace pagedllm_ops {

at::Tensor decode_burst(const at::Tensor& first_ids, const std::vector<int64_t>& counts,
                        const std::vector<int64_t>& context, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& inv_freq, double attention_factor,
                        const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& meta, double eps,
                        double scale, double softcap, bool use_amx, const std::vector<at::Tensor>& embedding,
                        int64_t embedding_bits, int64_t embedding_group_size, const std::vector<at::Tensor>& head,
                        int64_t head_bits, int64_t head_group_size, at::ScalarType dtype) {
  const int64_t n = static_cast<int64_t>(counts.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(context.size()) == n && first_ids.dim() == 1 && first_ids.size(0) == n &&
                  first_ids.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == n,
              "decode_burst: first_ids, counts, context and block_tables must have a row per sequence");
  TORCH_CHECK(embedding.size() == 1 || embedding.size() == 4, "decode_burst: the embedding is [weight] or "
              "[codes, scales, mins, codebook]");
  TORCH_CHECK(head.size() == 5, "decode_burst: the head is [codes, scales, mins, codebook, bias]");
  std::vector<int64_t> starts(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(counts[i] >= 1, "decode_burst: each sequence makes at least one token");
    starts[i + 1] = starts[i] + counts[i];
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == starts[n],
              "decode_burst: slot_mapping must have one slot per token the burst makes");
  const int64_t steps = *std::max_element(counts.begin(), counts.end());
  at::Tensor tokens = at::full({n, steps}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* out = tokens.mutable_data_ptr<int64_t>();
  std::vector<int64_t> current(first_ids.const_data_ptr<int64_t>(), first_ids.const_data_ptr<int64_t>() + n);
  const at::Tensor no_lora_slots = at::empty({0}, at::TensorOptions().dtype(at::kLong));
  for (int64_t j = 0; j < steps; ++j) {
    std::vector<int64_t> active, rows, ids, positions, seq_lens, query_start(1, 0);
    for (int64_t i = 0; i < n; ++i) {
      if (counts[i] <= j) continue;
      active.push_back(i);
      rows.push_back(starts[i] + j);
      ids.push_back(current[i]);
      positions.push_back(context[i] + j);
      seq_lens.push_back(context[i] + j + 1);
      query_start.push_back(static_cast<int64_t>(query_start.size()));
    }
    const at::Tensor id_tensor = longs(ids);
    const at::Tensor x =
        embedding.size() == 1
            ? at::embedding(embedding[0], id_tensor)
            : quant_embedding(embedding[0], embedding[1], present(embedding[2]), present(embedding[3]),
                              embedding_bits, embedding_group_size, id_tensor, dtype);
    // model/rope.py's RotaryEmbedding.forward over these positions
    const at::Tensor freqs = longs(positions).unsqueeze(1).to(at::kFloat) * inv_freq;
    const at::Tensor angles = at::cat({freqs, freqs}, -1);
    at::Tensor cos = angles.cos(), sin = angles.sin();
    if (attention_factor != 1.0) {
      cos = cos * attention_factor;
      sin = sin * attention_factor;
    }
    const bool all = static_cast<int64_t>(active.size()) == n;
    const at::Tensor hidden = decode_layers(
        x.contiguous(), tensors, meta, cos.to(dtype).contiguous(), sin.to(dtype).contiguous(),
        slot_mapping.index_select(0, longs(rows)), all ? block_tables : block_tables.index_select(0, longs(active)),
        ints(seq_lens), ints(query_start), eps, scale, softcap, use_amx, no_lora_slots);
    const at::Tensor picked = quant_linear_argmax(hidden, head[0], head[1], present(head[2]), present(head[3]),
                                                  head_bits, head_group_size, present(head[4]));
    const int64_t* pick = picked.const_data_ptr<int64_t>();
    for (size_t a = 0; a < active.size(); ++a) {
      current[active[a]] = pick[a];
      out[active[a] * steps + j] = pick[a];
    }
  }
  return tokens;
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("decode_burst(Tensor first_ids, int[] counts, int[] context, Tensor slot_mapping, Tensor block_tables, "
        "Tensor inv_freq, float attention_factor, Tensor(a!)[] tensors, int[] meta, float eps, float scale, "
        "float softcap, bool use_amx, Tensor[] embedding, int embedding_bits, int embedding_group_size, "
        "Tensor[] head, int head_bits, int head_group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("decode_burst", &pagedllm_ops::decode_burst); }
