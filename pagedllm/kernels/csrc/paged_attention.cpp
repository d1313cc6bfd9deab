// Paged attention for CPUs with AVX-512: reads K/V in place through the block table (no gathered
// copy), one online softmax per query row, prefill chunks and decodes of many requests in one call.
//
// Layout (as pagedllm.attention allocates it): key_cache/value_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; query/out [T, num_heads, head_dim]; request b's new tokens are rows
// query_start_loc[b] .. query_start_loc[b+1] and it has seq_lens[b] tokens in context.
//
// The caches hold the query's dtype, or compressed codes (int8, fp8 e4m3, fp8 e5m2) with fp16
// scales [num_blocks, block_size, num_kv_heads] beside them (element = code * scale). Codes are
// turned to fp32 where K/V rows are loaded; a key's scale multiplies its scores (folded into the
// softmax scale) and a value's its probability, so scales cost no work per element. write_kv
// quantizes each new token as pagedllm.attention.kv_quant does, bit for bit.
//
// Work is cut into items (request, tile of up to kQueryTile new tokens, kv head). An item's rows are
// its tokens x the query heads sharing that kv head (GQA), so each K/V row is read once for all of
// them. Keys go by in tiles of 16: scores as 16-lane dot products folded by a transpose-add tree,
// soft-capped where asked (Gemma 2), then the online softmax update and P.V, all in fp32. Threads
// take items from a shared counter, longest first, through ATen's thread pool (torch.set_num_threads
// applies).
//
// With bf16 queries and cache where the CPU has AMX, prefill items (many rows) take the tile unit
// instead (run_item_amx): tiles of 16 rows x 32 dims of Q times 16 keys of K^T for the scores, then
// the probabilities, rounded to bf16 as torch's flash attention rounds them, times V for the output,
// 64 keys per online-softmax update. Decodes (one new token; blocks of 16 or more) take it for the
// scores only (run_decode_amx): K tiles straight from the cache against all query heads at once,
// the softmax across query heads in vector lanes, P.V on the vector unit; they read their K/V once,
// so each key's prefetch of a later tile goes with its P.V, keeping memory busy while it computes
// (a burst of prefetches per tile stalled the core behind them: 15 -> 18.5 GB/s on two cores).
//
// The code, a file per path: attention_common.h (shared pieces), attention_kernel.h (the vector
// unit), attention_amx_prefill.h and attention_amx_decode.h (the tile unit), this file (the plan of
// work items, the entry points), write_kv.cpp (the cache writes, compressed or not), dispatch.h (the
// dtype dispatch), attention_registration.cpp (the torch ops).

#include "attention_amx_decode.h"
#include "attention_amx_prefill.h"
#include "attention_kernel.h"
#include "dispatch.h"

namespace pagedllm_attention {

// Decodes (and other short queries) take all kv heads in one item, reading each cached token's
// K/V row whole; prefill chunks are cut into tiles of kQueryTile tokens (on the tile unit, enough
// tokens for about kAmxRows rows), one item per kv head.
template <typename P>
std::vector<WorkItem> plan(const P& p, int64_t num_seqs, bool amx) {
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
      int64_t keys = ctx_len - q_len + t + n;
      if (p.sliding_window > 0) keys = std::min(keys, p.sliding_window + n);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({b, t, n, h, 1, keys * n});
    }
  }
  // Longest first, so the last items to start are short ones and threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

template <typename T, typename C, int D>
void run(const Problem<T, C>& p, int64_t num_seqs, bool use_amx) {
  using K = Kernel<T, C, D>;
  const bool amx = K::kAmx && use_amx && !p.row_invariant && amx_ready();
  const std::vector<WorkItem> items = plan(p, num_seqs, amx);
  const int64_t group = p.num_heads / p.num_kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch scratch;
#ifdef PAGEDLLM_AMX
    if (amx) configure_tiles();
#endif
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const WorkItem& item = items[i];
#ifdef PAGEDLLM_AMX
      if constexpr (K::kAmx) {
        if (amx && item.num_tokens * group > kDotRows) {
          K::run_item_amx(p, item, scratch);
          continue;
        }
        if (amx && K::decode_fits_amx(p, item)) {
          K::run_decode_amx(p, item, scratch);
          continue;
        }
      }
#endif
      K::run_item(p, item, scratch);
    }
#ifdef PAGEDLLM_AMX
    if (amx) _tile_release();
#endif
  });
}

template <typename T, typename C>
void run_any_head_dim(const Problem<T, C>& p, int64_t num_seqs, bool use_amx) {
  switch (p.head_dim) {
    case 16: return run<T, C, 16>(p, num_seqs, use_amx);
    case 32: return run<T, C, 32>(p, num_seqs, use_amx);
    case 64: return run<T, C, 64>(p, num_seqs, use_amx);
    case 128: return run<T, C, 128>(p, num_seqs, use_amx);
    case 256: return run<T, C, 256>(p, num_seqs, use_amx);
    default: TORCH_CHECK(false, "paged_attention: head_dim ", p.head_dim, " is not compiled in");
  }
}

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
    run_any_head_dim(p, num_seqs, use_amx);
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

bool attention_amx_available() { return amx_ready(); }

}  // namespace pagedllm_attention
