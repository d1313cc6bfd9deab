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
// The code, a file per path: attention_plan.h (the Problem and its work items, every tier's),
// attention_entry.cpp (the checked entry points, every tier's), attention_common.h (the AVX-512
// pieces), attention_kernel.h (the vector unit), attention_amx_prefill.h and attention_amx_decode.h
// (the tile unit), this file (the AVX-512 tiers' run_problem), attention_avx2.cpp (the AVX2
// tier's), write_kv.cpp (the cache writes, compressed or not), dispatch.h (the dtype dispatch),
// attention_registration.cpp (the torch ops).

#include "attention_amx_decode.h"
#include "attention_amx_prefill.h"
#include "attention_kernel.h"
#include "dispatch.h"

namespace pagedllm_attention {

template <typename T, typename C, int D>
void run(const Problem<T, C>& p, int64_t num_seqs, bool use_amx) {
  using K = Kernel<T, C, D>;
  const bool amx = K::kAmx && use_amx && !p.row_invariant && amx_ready();
  // Off the tile unit every head is computed alike in any item, so fewer decode items than
  // threads (one stream) split per kv head and run on every thread; the tile unit's decode
  // takes all of a token's heads at once.
  const std::vector<WorkItem> items = plan(p, num_seqs, amx, amx ? 0 : at::get_num_threads());
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
void run_problem(const Problem<T, C>& p, int64_t num_seqs, bool use_amx) {
  switch (p.head_dim) {
    case 16: return run<T, C, 16>(p, num_seqs, use_amx);
    case 32: return run<T, C, 32>(p, num_seqs, use_amx);
    case 64: return run<T, C, 64>(p, num_seqs, use_amx);
    case 128: return run<T, C, 128>(p, num_seqs, use_amx);
    case 256: return run<T, C, 256>(p, num_seqs, use_amx);
    default: TORCH_CHECK(false, "paged_attention: head_dim ", p.head_dim, " is not compiled in");
  }
}

PAGEDLLM_INSTANTIATE_RUN_PROBLEM

bool attention_amx_available() { return amx_ready(); }

}  // namespace pagedllm_attention
