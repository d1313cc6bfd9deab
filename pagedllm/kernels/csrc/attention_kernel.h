// The vector-unit attention kernel (AVX-512): scores as dot products or against a transposed K tile,
// the online softmax and P.V in fp32, for prefill chunks and decodes alike (run_item); the AMX
// paths are declared here and defined in attention_amx_prefill.h and attention_amx_decode.h.
#pragma once

#include "attention_common.h"

namespace pagedllm_attention {

template <typename T, typename C, int D>
struct Kernel {
  static constexpr int NC = D / 16;                                  // 512-bit fp32 chunks per row
  static constexpr int PV_ROWS = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);  // rows per P.V register block
  // Against compressed K/V the query rows are read in fp32, converted once per work item.
  using Q = std::conditional_t<std::is_same_v<C, T>, T, float>;
  // bf16 scores with AVX512-BF16: pairs of bf16 products summed in fp32 (exact products), no
  // conversion of K at all.
  static constexpr bool kBf16 = std::is_same_v<Q, c10::BFloat16> && kHaveBf16Dot;
  static constexpr bool kCompressed = !std::is_same_v<C, T>;
#ifdef PAGEDLLM_AMX
  // A tile row holds 32 bf16: whole tiles of Q and K need D a multiple of 32.
  static constexpr bool kAmx = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T> && D % 32 == 0;
#else
  static constexpr bool kAmx = false;
#endif

  // The 16 rows of a tile in fp32 (kf[j * D ...]), pointed to by f32_rows.
  template <typename S>
  static void rows_to_f32(const S* const* rows, float* kf, const float** f32_rows) {
    for (int j = 0; j < kKeyTile; ++j) {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(kf + j * D + c * 16, load_f32(rows[j] + c * 16));
      f32_rows[j] = kf + j * D;
    }
  }

  // scores[r][j] = q[r] . k[j] for a few rows: 16-lane dot products folded by sum_lanes_16. K rows
  // are the cache's, or fp32.
  template <typename K>
  static void scores_dot(const Q* const* qrows, int64_t rows, const K* const* krows, float* scores) {
    for (int64_t r = 0; r < rows; ++r) {
      __m512 partial[kKeyTile];
      for (int j = 0; j < kKeyTile; ++j) partial[j] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
      if constexpr (kBf16 && std::is_same_v<K, c10::BFloat16>) {
        for (int c = 0; c < D; c += 32) {
          const __mmask32 m = D - c >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
          const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, qrows[r] + c);
          for (int j = 0; j < kKeyTile; ++j) {
            partial[j] = _mm512_dpbf16_ps(partial[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, krows[j] + c));
          }
        }
        _mm512_storeu_ps(scores + r * kKeyTile, sum_lanes_16(partial));
        continue;
      }
#endif
      for (int c = 0; c < NC; ++c) {
        const __m512 qv = load_f32(qrows[r] + c * 16);
        for (int j = 0; j < kKeyTile; ++j) partial[j] = _mm512_fmadd_ps(qv, load_f32(krows[j] + c * 16), partial[j]);
      }
      _mm512_storeu_ps(scores + r * kKeyTile, sum_lanes_16(partial));
    }
  }

  // The same for many rows (a multiple of kTiledRows) from K transposed once per tile: in fp32
  // (kt[d][j]), or with AVX512-BF16 as bf16 pairs (kt[d/2][j] = k[j][d], k[j][d+1]).
  static void scores_tiled(const Q* const* qrows, int64_t rows, const C* const* krows, float* kf, float* kt,
                           float* scores) {
#ifdef __AVX512BF16__
    if constexpr (kBf16) {
      constexpr int P = D / 2;  // bf16 pairs per row
      for (int c = 0; c < P; c += 16) {
        transpose_16x16(reinterpret_cast<const float* const*>(krows), c, std::min(16, P - c), kt + c * kKeyTile);
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kTiledRows) {
        __m512 acc[kTiledRows];
        const int32_t* q[kTiledRows];
        for (int i = 0; i < kTiledRows; ++i) {
          acc[i] = _mm512_setzero_ps();
          q[i] = reinterpret_cast<const int32_t*>(qrows[r0 + i]);
        }
        for (int d = 0; d < P; ++d) {
          const __m512bh kd = (__m512bh)_mm512_loadu_ps(kt + d * kKeyTile);
          for (int i = 0; i < kTiledRows; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(q[i][d]), kd);
        }
        for (int i = 0; i < kTiledRows; ++i) _mm512_storeu_ps(scores + (r0 + i) * kKeyTile, acc[i]);
      }
      return;
    }
#endif
    const float* kf_rows[kKeyTile];
    rows_to_f32(krows, kf, kf_rows);  // K rows in fp32, then transposed
    for (int c = 0; c < NC; ++c) transpose_16x16(kf_rows, c * 16, 16, kt + c * 16 * kKeyTile);
    for (int64_t r0 = 0; r0 < rows; r0 += kTiledRows) {
      __m512 acc[kTiledRows];
      for (int i = 0; i < kTiledRows; ++i) acc[i] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m512 kd = _mm512_loadu_ps(kt + d * kKeyTile);
        for (int i = 0; i < kTiledRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(to_float(qrows[r0 + i][d])), kd, acc[i]);
      }
      for (int i = 0; i < kTiledRows; ++i) _mm512_storeu_ps(scores + (r0 + i) * kKeyTile, acc[i]);
    }
  }

  // Where a P.V pass also asks for a later tile's rows: key j's K and V at k + j * stride and
  // v + j * stride (one kv head's D elements each), so memory works while this tile computes.
  struct Ahead {
    const char* k;
    const char* v;
    int64_t stride;
  };

  // o[r] = o[r] * corr[r] + sum_{j < n} probs[r * row_stride + j * key_stride] v[j] for R rows;
  // v rows in fp32 or the cache dtype. ahead: see Ahead (null: nothing asked for).
  template <int R, typename S>
  static void pv_block(float* o, const float* corr, const float* probs, int64_t row_stride, int64_t key_stride,
                       const S* const* vrows, int n, const Ahead* ahead) {
    __m512 acc[R][NC];
    for (int i = 0; i < R; ++i) {
      const __m512 ci = _mm512_set1_ps(corr[i]);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c * 16), ci);
    }
    for (int j = 0; j < n; ++j) {
      if (ahead != nullptr) {
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(C)); b += 64) {
          _mm_prefetch(ahead->k + j * ahead->stride + b, _MM_HINT_T1);
          _mm_prefetch(ahead->v + j * ahead->stride + b, _MM_HINT_T1);
        }
      }
      __m512 vj[NC];
      for (int c = 0; c < NC; ++c) vj[c] = load_f32(vrows[j] + c * 16);
      for (int i = 0; i < R; ++i) {
        const __m512 pij = _mm512_set1_ps(probs[i * row_stride + j * key_stride]);
        for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(pij, vj[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + i * D + c * 16, acc[i][c]);
    }
  }

  // pv_block over any number of rows, PV_ROWS at a time (ahead taken by the first block only).
  template <typename S>
  static void accumulate_pv(float* o, int64_t rows, const float* corr, const float* probs, int64_t row_stride,
                            int64_t key_stride, const S* const* vrows, int n, const Ahead* ahead = nullptr) {
    int64_t r = 0;
    for (; r + PV_ROWS <= rows; r += PV_ROWS, ahead = nullptr) {
      pv_block<PV_ROWS>(o + r * D, corr + r, probs + r * row_stride, row_stride, key_stride, vrows, n, ahead);
    }
    const float* pr = probs + r * row_stride;
    switch (rows - r) {  // at most PV_ROWS - 1 <= 3 left
      case 3: pv_block<3>(o + r * D, corr + r, pr, row_stride, key_stride, vrows, n, ahead); break;
      case 2: pv_block<2>(o + r * D, corr + r, pr, row_stride, key_stride, vrows, n, ahead); break;
      case 1: pv_block<1>(o + r * D, corr + r, pr, row_stride, key_stride, vrows, n, ahead); break;
      default: break;
    }
  }

  // Per-key factors of one tile for kv head h: each key's scale (times the softmax scale) and each
  // value's; without scales, the softmax scale and ones.
  static void tile_factors(const Problem<T, C>& p, const int64_t* slots, int n, int64_t h, __m512 scale,
                           __m512& key_factor, __m512& value_factor) {
    if (p.key_scale == nullptr) {
      key_factor = scale;
      value_factor = _mm512_set1_ps(1.0f);
      return;
    }
    alignas(32) uint16_t ks[kKeyTile] = {}, vs[kKeyTile] = {};  // fp16 bits; past the end 0 (masked anyway)
    for (int j = 0; j < n; ++j) {
      ks[j] = p.key_scale[slots[j] * p.num_kv_heads + h].x;
      vs[j] = p.value_scale[slots[j] * p.num_kv_heads + h].x;
    }
    key_factor = _mm512_mul_ps(scale, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ks))));
    value_factor = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(vs)));
  }

#ifdef PAGEDLLM_AMX
  // On the tile unit: defined in attention_amx_prefill.h and attention_amx_decode.h.
  static void run_item_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc);
  static bool decode_fits_amx(const Problem<T, C>& p, const WorkItem& item);
  static void prefetch_rows(const C* row, int64_t nh, int64_t token_stride);
  static void run_decode_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc);
#endif

  static void run_item(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
    const int64_t group = p.num_heads / p.num_kv_heads;
    const int64_t rows = item.num_tokens * group;  // per kv head: token r / group, query head r % group
    const bool dot = rows <= kDotRows || p.row_invariant;
    const int64_t padded = dot ? rows : round_up(rows, kTiledRows);
    const int64_t q_begin = p.query_start_loc[item.seq];
    const int64_t q_len = p.query_start_loc[item.seq + 1] - q_begin;
    const int64_t ctx_len = p.seq_lens[item.seq];
    const int64_t first_pos = ctx_len - q_len + item.token_begin;  // of the item's first token
    const int64_t last_pos = first_pos + item.num_tokens - 1;
    const int64_t key_end = last_pos + 1;
    int64_t key_begin = p.sliding_window > 0 ? std::max<int64_t>(0, first_pos - p.sliding_window + 1) : 0;
    if (p.row_invariant) key_begin -= key_begin % kKeyTile;  // keys before the window are masked
    const int32_t* table = p.block_tables + item.seq * p.table_stride;
    const int64_t token_stride = p.num_kv_heads * D;  // between consecutive tokens in the cache
    const C* zero_row = reinterpret_cast<const C*>(kZeroRow);

    sc.reserve(item.num_heads, padded, D);
    std::fill(sc.o.begin(), sc.o.end(), 0.0f);
    std::fill(sc.m.begin(), sc.m.end(), kNoScore);
    std::fill(sc.l.begin(), sc.l.end(), 0.0f);
    std::vector<const Q*> qrows(item.num_heads * padded, reinterpret_cast<const Q*>(kZeroRow));  // padding rows read zeros
    for (int64_t hh = 0; hh < item.num_heads; ++hh) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = (item.head_begin + hh) * group + r % group;
        const T* row = p.query + (q_begin + item.token_begin + r / group) * p.query_stride + head * D;
        if constexpr (std::is_same_v<Q, T>) {
          qrows[hh * padded + r] = row;
        } else {
          float* qf = sc.q.data() + (hh * padded + r) * D;
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(qf + c * 16, load_f32(row + c * 16));
          qrows[hh * padded + r] = qf;
        }
      }
    }

    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_set1_ps(p.scale);
    const __m512 softcap = _mm512_set1_ps(p.softcap), inv_softcap = _mm512_set1_ps(1.0f / p.softcap);
    int64_t slots[kKeyTile];
    const C* krows[kKeyTile];
    const C* vrows[kKeyTile];
    const float* kf_rows[kKeyTile];
    const float* vf_rows[kKeyTile];
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
      const int n = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - k0));
      for (int j = 0; j < n; ++j) {
        const int64_t pos = k0 + j;
        slots[j] = p.slot(table, pos);
      }
      // The KV the next tile needs (a decode reads it once, in scattered blocks the hardware
      // prefetcher does not follow) starts coming from memory now. Few rows where that tile lies
      // in one block: asked for key by key inside each head's P.V pass (pv_block's Ahead), which
      // kept the core's misses in flight steadily and made decodes from DRAM 1.16-1.23x faster
      // than asking for the whole tile at once (ep-2c, docs/cpu-tiers.md); else the whole tile here.
      // Into L2 (T1), not L1: a request to L1 holds one of the core's few L1 miss buffers until
      // its line arrives, which capped the lines in flight; L2 tracks many more. Cold caches on
      // ep-2c, 2 threads: 16 decodes 1.1-1.5x faster, 16 five-token verifications 1.1-1.4x, one
      // stream at 1,000 keys 1.1-2x, none slower.
      const char* next_k = nullptr;
      const char* next_v = nullptr;
      const int64_t next = k0 + kKeyTile;
      if (dot && next + kKeyTile <= key_end) {
        const int64_t s0 = p.slot(table, next);
        if (p.slot(table, next + kKeyTile - 1) == s0 + kKeyTile - 1) {
          next_k = reinterpret_cast<const char*>(p.key_cache + s0 * token_stride);
          next_v = reinterpret_cast<const char*>(p.value_cache + s0 * token_stride);
        }
      }
      if (next_k == nullptr) {
        const int64_t bytes = item.num_heads * D * static_cast<int64_t>(sizeof(C));
        for (int64_t pos = next; pos < std::min(next + kKeyTile, key_end); ++pos) {
          const int64_t slot = p.slot(table, pos);
          const char* kp = reinterpret_cast<const char*>(p.key_cache + slot * token_stride + item.head_begin * D);
          const char* vp = reinterpret_cast<const char*>(p.value_cache + slot * token_stride + item.head_begin * D);
          for (int64_t b = 0; b < bytes; b += 64) { _mm_prefetch(kp + b, _MM_HINT_T1); _mm_prefetch(vp + b, _MM_HINT_T1); }
        }
      }
      const bool needs_mask = n < kKeyTile || k0 + n - 1 > first_pos ||
                              (p.sliding_window > 0 && k0 <= last_pos - p.sliding_window);
      const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0)), lane);
      const __mmask16 in_tile = static_cast<__mmask16>((1u << n) - 1);

      for (int64_t hh = 0; hh < item.num_heads; ++hh) {
        const int64_t h = item.head_begin + hh;
        for (int j = 0; j < kKeyTile; ++j) {  // past the end: zero rows (their weight is 0 anyway)
          krows[j] = j < n ? p.key_cache + slots[j] * token_stride + h * D : zero_row;
          vrows[j] = j < n ? p.value_cache + slots[j] * token_stride + h * D : zero_row;
        }
        __m512 key_factor, value_factor;
        tile_factors(p, slots, n, h, scale, key_factor, value_factor);
        float* probs = sc.probs.data();
        const Q* const* q = qrows.data() + hh * padded;
        if (dot && kCompressed && rows > 1) {  // codes to fp32 once, not once per row
          rows_to_f32(krows, sc.k.data(), kf_rows);
          scores_dot(q, rows, kf_rows, probs);
        } else if (dot) {
          scores_dot(q, rows, krows, probs);
        } else {
          scores_tiled(q, padded, krows, sc.k.data(), sc.kt.data(), probs);
        }
        float* m = sc.m.data() + hh * padded;
        float* l = sc.l.data() + hh * padded;
        for (int64_t r = 0; r < rows; ++r) {
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(probs + r * kKeyTile), key_factor);
          if (p.softcap > 0) s = _mm512_mul_ps(softcap, tanh_f32(_mm512_mul_ps(s, inv_softcap)));
          if (needs_mask) {
            // Keys past the end, after the row's own position (causal) or out of its window.
            const int64_t pos = first_pos + r / group;
            __mmask16 visible = in_tile & _mm512_cmp_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(pos)),
                                                                _MM_CMPINT_LE);
            if (p.sliding_window > 0) {
              visible &= _mm512_cmp_epi32_mask(
                  key_pos, _mm512_set1_epi32(static_cast<int>(pos - p.sliding_window)), _MM_CMPINT_GT);
            }
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, s);
          }
          // Online softmax: what was accumulated is rescaled to the new running max.
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(s));
          const __m512 e = exp_f32(_mm512_sub_ps(s, _mm512_set1_ps(m_new)));
          sc.corr[r] = std::exp(m[r] - m_new);
          l[r] = l[r] * sc.corr[r] + _mm512_reduce_add_ps(e);
          m[r] = m_new;
          _mm512_storeu_ps(probs + r * kKeyTile, _mm512_mul_ps(e, value_factor));
        }
        float* o = sc.o.data() + hh * padded * D;
        if (dot) {  // few rows: V straight from the cache
          const int64_t head_bytes = h * D * static_cast<int64_t>(sizeof(C));
          const Ahead ahead{next_k + head_bytes, next_v + head_bytes, token_stride * static_cast<int64_t>(sizeof(C))};
          accumulate_pv(o, rows, sc.corr.data(), probs, kKeyTile, 1, vrows, kKeyTile,
                        next_k != nullptr ? &ahead : nullptr);
        } else {  // many rows: V in fp32 once
          rows_to_f32(vrows, sc.v.data(), vf_rows);
          accumulate_pv(o, rows, sc.corr.data(), probs, kKeyTile, 1, vf_rows, kKeyTile);
        }
      }
    }

    for (int64_t hh = 0; hh < item.num_heads; ++hh) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = (item.head_begin + hh) * group + r % group;
        T* dst = p.out + ((q_begin + item.token_begin + r / group) * p.num_heads + head) * D;
        const float* o = sc.o.data() + (hh * padded + r) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / sc.l[hh * padded + r]);
        for (int c = 0; c < NC; ++c) store_f32(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + c * 16), inv));
      }
    }
  }
};

}  // namespace pagedllm_attention
