// What every tier's paged attention shares, with no vector instructions in it: the Problem one call
// describes, the work items it is cut into (plan) and the kernel each tier defines (run_problem:
// paged_attention.cpp on AVX-512, attention_avx2.cpp on AVX2). attention_entry.cpp checks a
// call's tensors and hands the Problem to run_problem.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedllm_attention {

constexpr int kKeyTile = 16;    // keys per tile (one 512-bit register of fp32 scores on AVX-512)
constexpr float kNoScore = -1e30f;  // running max before any key: finite, so no inf - inf
constexpr int kQueryTile = 16;  // new tokens per work item (prefill chunks are cut into these)

struct WorkItem {
  int64_t seq;
  int64_t token_begin;  // first new token of the item, counted within the request's new tokens
  int64_t num_tokens;
  int64_t head_begin, num_heads;  // kv heads
  int64_t cost;
};

constexpr int kAmxRows = 192;   // rows (tokens x the query heads of a kv head) an AMX item aims for

template <typename T, typename C>  // T: query/out dtype; C: what the cache holds (T, or codes)
struct Problem {
  const T* query;
  const C* key_cache;
  const C* value_cache;
  const c10::Half* key_scale;  // [slots, num_kv_heads]: element = code * scale; null: no scales
  const c10::Half* value_scale;
  T* out;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t query_stride;  // between tokens of query (out is contiguous)
  int64_t table_stride, block_size, num_heads, num_kv_heads, head_dim, sliding_window;
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  // Batch-invariant mode: every row takes the same path (the vector path's per-row dot products,
  // never AMX or the transposed-K tiles) and key tiles start at multiples of kKeyTile, so a row's
  // sums run in one order whatever else shares its work item (other tokens of its chunk, the chunk
  // size, a decode step).
  bool row_invariant = false;

  // Where position pos of a request lies: its slot through the request's block table. Shifts where
  // block_size is a power of two (the usual case: a division per key cost a fifth of a decode's
  // time with its K/V in cache).
  int64_t slot(const int32_t* table, int64_t pos) const {
    if ((block_size & (block_size - 1)) == 0) {
      const int shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));
      return (static_cast<int64_t>(table[pos >> shift]) << shift) | (pos & (block_size - 1));
    }
    return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  }
};

// Rows of this many or fewer (decodes: the query heads of one kv head) take dot products folded
// by sum_lanes_16; more rows amortize a transposed K tile and need no folding.
constexpr int64_t kDotRows = 8;

// Decodes (and other short queries) take all kv heads in one item, reading each cached token's
// K/V row whole, unless there are fewer of them than split_below (a tier's thread count, where its
// kernel computes each head alike in any item): then one item per kv head, so that one stream's
// decode runs on every thread. Prefill chunks are cut into tiles of kQueryTile tokens (on the tile
// unit, enough tokens for about kAmxRows rows), one item per kv head.
template <typename P>
int64_t tokens_cost(const P& p, int64_t seq, int64_t token_begin, int64_t num_tokens) {
  // The keys the item's last token sees (within the window), times its tokens: per kv head.
  const int64_t q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  int64_t keys = p.seq_lens[seq] - q_len + token_begin + num_tokens;
  if (p.sliding_window > 0) keys = std::min(keys, p.sliding_window + num_tokens);
  return keys * num_tokens;
}

template <typename P>
std::vector<WorkItem> plan(const P& p, int64_t num_seqs, bool amx, int64_t split_below = 0) {
  std::vector<WorkItem> items;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t query_tile = amx ? std::max<int64_t>(1, kAmxRows / group) : kQueryTile;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = p.query_start_loc[b + 1] - p.query_start_loc[b];
    const int64_t ctx_len = p.seq_lens[b];
    if (q_len == 0) continue;
    if (q_len * group <= kDotRows) {
      items.push_back({b, 0, q_len, 0, p.num_kv_heads, ctx_len * q_len * p.num_kv_heads});
      continue;
    }
    for (int64_t t = 0; t < q_len; t += query_tile) {
      const int64_t n = std::min<int64_t>(query_tile, q_len - t);
      const int64_t cost = tokens_cost(p, b, t, n);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({b, t, n, h, 1, cost});
    }
  }
  if (static_cast<int64_t>(items.size()) < split_below) {
    std::vector<WorkItem> split;
    for (const WorkItem& item : items) {
      for (int64_t h = 0; h < item.num_heads; ++h)
        split.push_back({item.seq, item.token_begin, item.num_tokens, item.head_begin + h, 1, item.cost / item.num_heads});
    }
    items.swap(split);
  }
  // Still fewer items than twice the threads where one is several tokens long (one stream
  // verifying a proposal: an item per kv head, 3 of them on 2 threads taking as long as 4):
  // halve the longest until there are enough, so the threads finish together.
  if (split_below > 0) {
    auto cost_of = [&](const WorkItem& item) {
      return tokens_cost(p, item.seq, item.token_begin, item.num_tokens) * item.num_heads;
    };
    while (static_cast<int64_t>(items.size()) < 2 * split_below) {
      const auto longest = std::max_element(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
        return a.num_tokens < b.num_tokens;
      });
      if (longest == items.end() || longest->num_tokens < 2) break;
      WorkItem rest = *longest;
      longest->num_tokens = (longest->num_tokens + 1) / 2;
      rest.token_begin += longest->num_tokens;
      rest.num_tokens -= longest->num_tokens;
      longest->cost = cost_of(*longest);
      rest.cost = cost_of(rest);
      items.push_back(rest);
    }
  }
  // Longest first, so the last items to start are short ones and threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// The tier's kernel over one call's Problem (num_seqs requests; use_amx: bf16 prefill may take the
// tile unit, where the tier has one). Defined, for every query dtype and cache dtype, by the
// tier's attention source.
template <typename T, typename C>
void run_problem(const Problem<T, C>& p, int64_t num_seqs, bool use_amx);

// Where a tier defines run_problem: its instances for every pair attention_entry.cpp dispatches to
// (float32 or bfloat16 queries over a cache of their dtype or of int8 / fp8 codes).
#define PAGEDLLM_INSTANTIATE_RUN_PROBLEM_FOR(T)                                       \
  template void run_problem(const Problem<T, T>&, int64_t, bool);                     \
  template void run_problem(const Problem<T, int8_t>&, int64_t, bool);                \
  template void run_problem(const Problem<T, c10::Float8_e4m3fn>&, int64_t, bool);    \
  template void run_problem(const Problem<T, c10::Float8_e5m2>&, int64_t, bool);
#define PAGEDLLM_INSTANTIATE_RUN_PROBLEM        \
  PAGEDLLM_INSTANTIATE_RUN_PROBLEM_FOR(float)   \
  PAGEDLLM_INSTANTIATE_RUN_PROBLEM_FOR(c10::BFloat16)

}  // namespace pagedllm_attention
