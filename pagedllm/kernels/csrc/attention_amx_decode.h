// Decodes with their scores on the AMX tile unit (Kernel::run_decode_amx): K tiles straight from
// the cache against all query heads at once, the softmax across heads in vector lanes, P.V on the
// vector unit, later K/V rows prefetched meanwhile.
#pragma once

#include "attention_kernel.h"

#ifdef PAGEDLLM_AMX
namespace pagedllm_attention {

// Whether a decode item (one new token) can take run_decode_amx: key tiles of 16 never cross a
// block, and a kv head's query heads fit the 16 columns of a score tile.
template <typename T, typename C, int D>
bool Kernel<T, C, D>::decode_fits_amx(const Problem<T, C>& p, const WorkItem& item) {
  return item.num_tokens == 1 && p.block_size % kKeyTile == 0 && p.num_heads / p.num_kv_heads <= 16;
}

// Asks for the nh heads (from row) of 16 consecutive cache rows, token_stride apart, in L1.
template <typename T, typename C, int D>
void Kernel<T, C, D>::prefetch_rows(const C* row, int64_t nh, int64_t token_stride) {
  const int64_t bytes = nh * D * static_cast<int64_t>(sizeof(C));
  for (int j = 0; j < kKeyTile; ++j) {
    const char* r = reinterpret_cast<const char*>(row + j * token_stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
  }
}

// One decode (a single new token, all its query heads) with the scores on the tile unit. The
// kv heads are taken a few at a time, as many as put their query heads (the columns) in one
// 16-wide score tile: scores^T [16 keys x 16 columns] = K rows (A, straight from the cache: 32
// dims of a head per tile, 16 consecutive keys of one block) times Q^T (B: each column's query
// head as bf16 pairs, zero outside its kv head's dims). Per 16 keys: the scores, one online
// softmax update in that layout (a column per query head, so max, exp and sum run across lanes
// with no horizontal folds), then P.V in fp32 on the vector unit; the K/V rows of the keys
// kPrefetchTiles ahead are asked for meanwhile.
template <typename T, typename C, int D>
void Kernel<T, C, D>::run_decode_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
  constexpr int kRuns = D / 32;  // A tiles (32 dims) per kv head
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t heads_per_tile = 16 / group;
  const int64_t q_row = p.query_start_loc[item.seq];
  const int64_t key_end = p.seq_lens[item.seq];
  const int64_t pos = key_end - 1;
  const int64_t key_begin = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  const int64_t tiles_begin = key_begin - key_begin % kKeyTile;
  const int32_t* table = p.block_tables + item.seq * p.table_stride;
  const int64_t token_stride = p.num_kv_heads * D;
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 softcap = _mm512_set1_ps(p.softcap), inv_softcap = _mm512_set1_ps(1.0f / p.softcap);
  sc.probs.resize(kKeyTile * 16);
  sc.o.resize(16 * D);
  sc.kp.resize(heads_per_tile * kRuns * 256);
  float* st = sc.probs.data();  // [key of the tile][column]: scores, then probabilities
  float* o = sc.o.data();       // [column][D]
  uint32_t* qt = sc.kp.data();  // [kv head in tile][run][16 pairs][16 columns]
  const C* vrows[kKeyTile];
  alignas(64) float corr[16];

  for (int64_t h0 = item.head_begin; h0 < item.head_begin + item.num_heads; h0 += heads_per_tile) {
    const int64_t nh = std::min(heads_per_tile, item.head_begin + item.num_heads - h0);
    const int64_t cols = nh * group;  // column c: query head h0 * group + c
    std::memset(qt, 0, nh * kRuns * 256 * sizeof(uint32_t));
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t* q = reinterpret_cast<const uint32_t*>(p.query + q_row * p.query_stride + (h0 * group + c) * D);
      uint32_t* dst = qt + (c / group) * kRuns * 256 + c;
      for (int64_t pair = 0; pair < D / 2; ++pair) dst[(pair / 16) * 256 + (pair % 16) * 16] = q[pair];
    }
    std::fill(o, o + 16 * D, 0.0f);
    __m512 m = _mm512_set1_ps(kNoScore), l = _mm512_setzero_ps();
    for (int64_t t = tiles_begin; t < std::min(key_end, tiles_begin + kPrefetchTiles * kKeyTile); t += kKeyTile) {
      prefetch_rows(p.key_cache + p.slot(table, t) * token_stride + h0 * D, nh, token_stride);
      prefetch_rows(p.value_cache + p.slot(table, t) * token_stride + h0 * D, nh, token_stride);
    }

    for (int64_t k0 = tiles_begin; k0 < key_end; k0 += kKeyTile) {
      const int64_t slot = p.slot(table, k0);
      const int64_t later = k0 + kPrefetchTiles * kKeyTile;
      const int64_t later_slot = later < key_end ? p.slot(table, later) : -1;
      const C* krow = p.key_cache + slot * token_stride;
      _tile_zero(0);
      for (int64_t hh = 0; hh < nh; ++hh) {
        for (int r = 0; r < kRuns; ++r) {
          _tile_loadd(1, krow + (h0 + hh) * D + 32 * r, token_stride * sizeof(C));
          _tile_loadd(2, qt + (hh * kRuns + r) * 256, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
      _tile_stored(0, st, 64);
      // Keys [j0, j1) of the tile are in [key_begin, key_end); the others get no weight.
      const int j0 = static_cast<int>(std::max<int64_t>(0, key_begin - k0));
      const int j1 = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - k0));
      __m512 s[kKeyTile];
      __m512 top = m;
      for (int j = j0; j < j1; ++j) {
        s[j] = _mm512_mul_ps(_mm512_loadu_ps(st + j * 16), scale);
        if (p.softcap > 0) s[j] = _mm512_mul_ps(softcap, tanh_f32(_mm512_mul_ps(s[j], inv_softcap)));
        top = _mm512_max_ps(top, s[j]);
      }
      _mm512_store_ps(corr, exp_f32(_mm512_sub_ps(m, top)));
      __m512 sum = _mm512_setzero_ps();
      for (int j = j0; j < j1; ++j) {
        const __m512 e = exp_f32(_mm512_sub_ps(s[j], top));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(st + j * 16, e);
      }
      l = _mm512_add_ps(_mm512_mul_ps(l, _mm512_load_ps(corr)), sum);
      m = top;
      const C* vrow = p.value_cache + slot * token_stride;
      const bool ask = later_slot >= 0 && j0 == 0;  // a whole tile: its keys cover the later tile's
      for (int64_t hh = 0; hh < nh; ++hh) {
        for (int j = j0; j < j1; ++j) vrows[j] = vrow + j * token_stride + (h0 + hh) * D;
        Ahead ahead{};
        if (ask) {
          ahead = {reinterpret_cast<const char*>(p.key_cache + later_slot * token_stride + (h0 + hh) * D),
                   reinterpret_cast<const char*>(p.value_cache + later_slot * token_stride + (h0 + hh) * D),
                   token_stride * static_cast<int64_t>(sizeof(C))};
        }
        // probs: a column per query head (row stride 1), a row of 16 per key
        accumulate_pv(o + hh * group * D, group, corr + hh * group, st + j0 * 16 + hh * group, 1, 16, vrows + j0,
                      j1 - j0, ask ? &ahead : nullptr);
      }
    }
    alignas(64) float lf[16];
    _mm512_store_ps(lf, l);
    for (int64_t c = 0; c < cols; ++c) {
      T* dst = p.out + (q_row * p.num_heads + h0 * group + c) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / lf[c]);
      for (int d = 0; d < D; d += 16) store_f32(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + c * D + d), inv));
    }
  }
}

}  // namespace pagedllm_attention
#endif  // PAGEDLLM_AMX
