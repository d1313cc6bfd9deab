// A decode burst (pagedllm/engine/decode_burst.py) in one call: up to a few greedy sequences each
// make `counts[i]` tokens by decode steps one after another, each step's argmax the next step's
// input, without going back to Python between the steps. Each step is the one worker/runner.py's
// run_burst takes in Python, with the same calls in the same order (so the tokens are bit for bit
// its): the embeddings of the sequences still going (the quantized table's quant_embedding, or a
// plain table's embedding), their rotary cos/sin as model/rope.py computes them, every layer and
// the final norm in decode_layers, then the quantized LM head's argmax (quant_linear_argmax). In a
// burst of one stream that Python was ~8% of a token's time.
//
// With n-gram speculation (ks[i] > 0; spec_decode/ngram.py), each step of sequence i first looks
// its own tokens (histories[i]: prompt and output, ending with first_ids[i], then what the burst
// made) up by ngram.py's rule, and verifies the proposal as a speculative step does: its rows are
// the known token then the proposed ones at the following positions, and it keeps the proposal's
// prefix that matches the argmax of the rows before, then one more token. A step never makes more
// tokens than the sequence has slots left, and rows past the kept ones are overwritten by the next
// step's (their positions come again), so the slots end as those of the tokens made, as in a burst
// without proposals. Greedy tokens do not depend on the proposals: the speculation changes how many
// rows a step runs, not what the argmax chain is.
//
// The burst's rows come as a prepared step lays them out: sequence i's `counts[i]` slots one after
// another in slot_mapping, its first at position context[i] (its tokens before the burst). The
// embedding table comes as [weight] (plain) or [codes, scales, mins, codebook] (quantized; empty:
// none); the head as [codes, scales, mins, codebook, bias]. max_steps (0: none) ends the burst
// after that many steps even where sequences have slots left. Returns int64 [n, max count]: each
// sequence's tokens, -1 past those it made; and int64 [steps x sequences, 3]: for each step of
// each sequence, (i, tokens proposed, proposed tokens kept).

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

at::Tensor longs(const std::vector<int64_t>& values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong));
}

at::Tensor ints(const std::vector<int64_t>& values) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(at::kInt);
}

// spec_decode/ngram.py's lookup: at most k tokens that followed the latest occurrence of the
// longest suffix of t (min_n to max_n tokens) found earlier in t, read periodically past t's end;
// none without such a match. The same rule, step for step (tests/kernels/test_ngram_lookup.py).
std::vector<int64_t> ngram_proposal(const std::vector<int64_t>& t, int64_t min_n, int64_t max_n, int64_t k) {
  const int64_t length = static_cast<int64_t>(t.size());
  if (length < min_n + 1 || k <= 0) return {};
  std::vector<int64_t> ends, kept;
  for (int64_t e = 0; e < length - 1; ++e) {
    if (t[e] == t[length - 1]) ends.push_back(e);
  }
  int64_t match_len = 1;
  std::vector<int64_t> best = ends;
  while (!ends.empty() && match_len < max_n && match_len < length - 1) {
    kept.clear();
    for (const int64_t e : ends) {
      if (e >= match_len && t[e - match_len] == t[length - 1 - match_len]) kept.push_back(e);
    }
    ends.swap(kept);
    if (!ends.empty()) {
      ++match_len;
      best = ends;
    }
  }
  if (best.empty() || match_len < min_n) return {};
  const int64_t period = length - 1 - best.back();
  std::vector<int64_t> proposal(k);
  for (int64_t i = 0; i < k; ++i) proposal[i] = t[length - period + i % period];
  return proposal;
}

}  // namespace

namespace pagedllm_ops {

std::vector<int64_t> ngram_lookup(const at::Tensor& tokens, int64_t min_n, int64_t max_n, int64_t k) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "ngram_lookup: tokens must be int64 [L]");
  TORCH_CHECK(1 <= min_n && min_n <= max_n, "ngram_lookup: need 1 <= min_n <= max_n");
  const at::Tensor t = tokens.contiguous();
  return ngram_proposal(std::vector<int64_t>(t.const_data_ptr<int64_t>(), t.const_data_ptr<int64_t>() + t.numel()),
                        min_n, max_n, k);
}

std::tuple<at::Tensor, at::Tensor> decode_burst(
    const at::Tensor& first_ids, const std::vector<int64_t>& counts, const std::vector<int64_t>& context,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& inv_freq,
    double attention_factor, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& meta, double eps,
    double scale, double softcap, bool use_amx, const std::vector<at::Tensor>& embedding, int64_t embedding_bits,
    int64_t embedding_group_size, const std::vector<at::Tensor>& head, int64_t head_bits, int64_t head_group_size,
    at::ScalarType dtype, const std::vector<at::Tensor>& histories, const std::vector<int64_t>& ks,
    int64_t lookup_min, int64_t lookup_max, int64_t max_steps) {
  const int64_t n = static_cast<int64_t>(counts.size());
  TORCH_CHECK(n > 0 && static_cast<int64_t>(context.size()) == n && first_ids.dim() == 1 && first_ids.size(0) == n &&
                  first_ids.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == n,
              "decode_burst: first_ids, counts, context and block_tables must have a row per sequence");
  TORCH_CHECK(embedding.size() == 1 || embedding.size() == 4, "decode_burst: the embedding is [weight] or "
              "[codes, scales, mins, codebook]");
  TORCH_CHECK(head.size() == 5, "decode_burst: the head is [codes, scales, mins, codebook, bias]");
  const bool speculates = !ks.empty();
  TORCH_CHECK(!speculates || (static_cast<int64_t>(ks.size()) == n && static_cast<int64_t>(histories.size()) == n &&
                              1 <= lookup_min && lookup_min <= lookup_max),
              "decode_burst: speculation needs a k and a history per sequence, and 1 <= lookup_min <= lookup_max");
  const int64_t* first = first_ids.const_data_ptr<int64_t>();
  std::vector<int64_t> starts(n + 1, 0);
  std::vector<std::vector<int64_t>> history(speculates ? n : 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(counts[i] >= 1, "decode_burst: each sequence makes at least one token");
    starts[i + 1] = starts[i] + counts[i];
    if (!speculates) continue;
    const at::Tensor h = histories[i].contiguous();
    TORCH_CHECK(h.dim() == 1 && h.scalar_type() == at::kLong && h.numel() > 0 &&
                    h.const_data_ptr<int64_t>()[h.numel() - 1] == first[i] && ks[i] >= 0,
                "decode_burst: a history is int64 [L] ending with the sequence's first id, and k >= 0");
    history[i].assign(h.const_data_ptr<int64_t>(), h.const_data_ptr<int64_t>() + h.numel());
    history[i].reserve(history[i].size() + counts[i]);
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == starts[n],
              "decode_burst: slot_mapping must have one slot per token the burst makes");
  const int64_t width = *std::max_element(counts.begin(), counts.end());
  at::Tensor tokens = at::full({n, width}, -1, at::TensorOptions().dtype(at::kLong));
  int64_t* out = tokens.mutable_data_ptr<int64_t>();
  std::vector<int64_t> current(first, first + n), made(n, 0), trace;
  const at::Tensor no_lora_slots = at::empty({0}, at::TensorOptions().dtype(at::kLong));
  for (int64_t step = 0; max_steps <= 0 || step < max_steps; ++step) {
    // This step's rows: each sequence with slots left, its known token then its proposal.
    std::vector<int64_t> active, rows, ids, positions, seq_lens, query_start(1, 0);
    std::vector<std::vector<int64_t>> proposals;
    for (int64_t i = 0; i < n; ++i) {
      if (made[i] >= counts[i]) continue;
      active.push_back(i);
      const int64_t k = speculates ? std::min(ks[i], counts[i] - made[i] - 1) : 0;
      proposals.push_back(k > 0 ? ngram_proposal(history[i], lookup_min, lookup_max, k) : std::vector<int64_t>{});
      const std::vector<int64_t>& proposal = proposals.back();
      const int64_t num_rows = 1 + static_cast<int64_t>(proposal.size());
      for (int64_t r = 0; r < num_rows; ++r) {
        rows.push_back(starts[i] + made[i] + r);
        ids.push_back(r == 0 ? current[i] : proposal[r - 1]);
        positions.push_back(context[i] + made[i] + r);
      }
      seq_lens.push_back(context[i] + made[i] + num_rows);
      query_start.push_back(query_start.back() + num_rows);
    }
    if (active.empty()) break;
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
      const int64_t i = active[a];
      const std::vector<int64_t>& proposal = proposals[a];
      const int64_t* row = pick + query_start[a];
      int64_t kept = 0;  // the proposal's prefix the argmax of the rows before agrees with
      while (kept < static_cast<int64_t>(proposal.size()) && row[kept] == proposal[kept]) ++kept;
      for (int64_t r = 0; r <= kept; ++r) {
        out[i * width + made[i]++] = row[r];
        if (speculates) history[i].push_back(row[r]);
      }
      current[i] = row[kept];
      if (speculates) trace.insert(trace.end(), {i, static_cast<int64_t>(proposal.size()), kept});
    }
  }
  at::Tensor steps = longs(trace).view({-1, 3});
  return {tokens, steps};
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("decode_burst(Tensor first_ids, int[] counts, int[] context, Tensor slot_mapping, Tensor block_tables, "
        "Tensor inv_freq, float attention_factor, Tensor(a!)[] tensors, int[] meta, float eps, float scale, "
        "float softcap, bool use_amx, Tensor[] embedding, int embedding_bits, int embedding_group_size, "
        "Tensor[] head, int head_bits, int head_group_size, ScalarType dtype, Tensor[] histories, int[] ks, "
        "int lookup_min, int lookup_max, int max_steps) -> (Tensor, Tensor)");
  m.def("ngram_lookup(Tensor tokens, int min_n, int max_n, int k) -> int[]");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("decode_burst", &pagedllm_ops::decode_burst);
  m.impl("ngram_lookup", &pagedllm_ops::ngram_lookup);
}
