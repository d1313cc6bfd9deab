// Attention of prefill items on the AMX tile unit (Kernel::run_item_amx): bf16 Q and K^T tiles for
// the scores, the probabilities rounded to bf16 times V for the output, 64 keys per update.
#pragma once

#include "attention_kernel.h"

#ifdef PAGEDLLM_AMX
namespace pagedllm_attention {

// One item on the tile unit: its rows (tokens x the query heads of kv head item.head_begin), keys
// 64 at a time. Tiles 0-2: accumulator, A (Q or P rows), B (K^T or V as bf16 pairs).
template <typename T, typename C, int D>
void Kernel<T, C, D>::run_item_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
  constexpr int P2 = D / 2;  // bf16 pairs per row
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t rows = item.num_tokens * group;
  const int64_t blocks = (rows + 15) / 16, padded = blocks * 16;
  const int64_t q_begin = p.query_start_loc[item.seq];
  const int64_t q_len = p.query_start_loc[item.seq + 1] - q_begin;
  const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.token_begin;
  const int64_t last_pos = first_pos + item.num_tokens - 1;
  const int64_t key_end = last_pos + 1;
  const int64_t key_begin = p.sliding_window > 0 ? std::max<int64_t>(0, first_pos - p.sliding_window + 1) : 0;
  const int32_t* table = p.block_tables + item.seq * p.table_stride;
  const int64_t token_stride = p.num_kv_heads * D;
  const int64_t h = item.head_begin;
  const C* zero_row = reinterpret_cast<const C*>(kZeroRow);

  sc.reserve_amx(padded, D);
  uint16_t* q = sc.qb.data();
  for (int64_t r = 0; r < padded; ++r) {  // row r: token r / group, query head h * group + r % group
    if (r < rows) {
      const T* row = p.query + (q_begin + item.token_begin + r / group) * p.query_stride + (h * group + r % group) * D;
      std::memcpy(q + r * D, row, D * sizeof(T));
    } else {
      std::memset(q + r * D, 0, D * sizeof(T));
    }
  }
  float* o = sc.o.data();
  std::fill(sc.o.begin(), sc.o.end(), 0.0f);
  std::fill(sc.m.begin(), sc.m.end(), kNoScore);
  std::fill(sc.l.begin(), sc.l.end(), 0.0f);
  float* scores = sc.probs.data();
  uint16_t* probs = sc.pb.data();
  uint32_t* kt = sc.kp.data();  // [4 tiles of 16 keys][P2 pairs][16 keys]
  uint32_t* vt = sc.vp.data();  // [2 runs of 32 keys][D / 16 column tiles][16 key pairs][16 columns]

  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 softcap = _mm512_set1_ps(p.softcap), inv_softcap = _mm512_set1_ps(1.0f / p.softcap);
  const C* krows[kAmxKeys];
  const C* vrows[kAmxKeys];
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kAmxKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxKeys, key_end - k0));
    const int key_tiles = (n + 15) / 16, key_runs = (n + 31) / 32;
    for (int j = 0; j < key_runs * 32; ++j) {  // past n: zero rows
      if (j >= n) {
        krows[j] = vrows[j] = zero_row;
        continue;
      }
      const int64_t pos = k0 + j;
      const int64_t slot = p.slot(table, pos);
      krows[j] = p.key_cache + slot * token_stride + h * D;
      vrows[j] = p.value_cache + slot * token_stride + h * D;
    }
    for (int t = 0; t < key_tiles; ++t) {  // K^T: pair c of key j at kt[(t * P2 + c) * 16 + j]
      for (int c = 0; c < P2; c += 16) {
        transpose_16x16(reinterpret_cast<const float* const*>(krows + 16 * t), c, 16, reinterpret_cast<float*>(kt + (t * P2 + c) * 16));
      }
    }
    for (int64_t b = 0; b < blocks; ++b) {  // scores of rows 16b.. against the 4 tiles of 16 keys
      _tile_zero(0);  // one accumulator per key tile: four products in flight, one Q load for all
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < D; c += 32) {
        _tile_loadd(4, q + b * 16 * D + c, D * sizeof(T));
        const uint32_t* k = kt + (c / 2) * 16;  // key tile t: k + t * P2 * 16 (past key_tiles: unread)
        multiply_into(0, k);
        multiply_into(1, k + P2 * 16);
        multiply_into(2, k + 2 * P2 * 16);
        multiply_into(3, k + 3 * P2 * 16);
      }
      float* dst = scores + b * 16 * kAmxKeys;
      _tile_stored(0, dst, kAmxKeys * sizeof(float));
      _tile_stored(1, dst + 16, kAmxKeys * sizeof(float));
      _tile_stored(2, dst + 32, kAmxKeys * sizeof(float));
      _tile_stored(3, dst + 48, kAmxKeys * sizeof(float));
    }
    const bool needs_mask = n < kAmxKeys || k0 + n - 1 > first_pos ||
                            (p.sliding_window > 0 && k0 <= last_pos - p.sliding_window);
    // The online softmax, 16 rows at a time: each row's scores scaled, capped and masked in
    // place, then the 16 rows' maxima, corrections and sums folded together (one exp and two
    // folds for 16 rows, where each row took a libm exp and two horizontal reductions).
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
      __m512 tops[16], sums[16];
      for (int i = 0; i < 16; ++i) tops[i] = sums[i] = _mm512_setzero_ps();
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i, pos = first_pos + r / group;
        float* row = scores + r * kAmxKeys;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < key_tiles; ++t) {
          __m512 st = _mm512_mul_ps(_mm512_loadu_ps(row + t * 16), scale);
          if (p.softcap > 0) st = _mm512_mul_ps(softcap, tanh_f32(_mm512_mul_ps(st, inv_softcap)));
          if (needs_mask) {
            const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0 + 16 * t)), lane);
            __mmask16 visible = tail_mask(n - 16 * t) &
                                _mm512_cmp_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(pos)), _MM_CMPINT_LE);
            if (p.sliding_window > 0) {
              visible &= _mm512_cmp_epi32_mask(
                  key_pos, _mm512_set1_epi32(static_cast<int>(pos - p.sliding_window)), _MM_CMPINT_GT);
            }
            st = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, st);
          }
          _mm512_storeu_ps(row + t * 16, st);
          top = _mm512_max_ps(top, st);
        }
        tops[i] = top;
      }
      const __mmask16 live = tail_mask(nr);
      const __m512 m_old = _mm512_maskz_loadu_ps(live, sc.m.data() + r0);
      const __m512 m_new = _mm512_max_ps(m_old, fold_lanes_16<max_ps>(tops));  // kNoScore at least
      const __m512 corr = exp_f32(_mm512_sub_ps(m_old, m_new));
      alignas(64) float shift[16], corr_of[16];
      _mm512_store_ps(shift, m_new);
      _mm512_store_ps(corr_of, corr);
      for (int i = 0; i < nr; ++i) {
        const int64_t r = r0 + i;
        const float* row = scores + r * kAmxKeys;
        const __m512 m = _mm512_set1_ps(shift[i]);
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < key_tiles; ++t) {
          const __m512 e = exp_f32(_mm512_sub_ps(_mm512_loadu_ps(row + t * 16), m));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * kAmxKeys + 16 * t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sums[i] = sum;
        if (corr_of[i] != 1.0f) {
          const __m512 c = _mm512_set1_ps(corr_of[i]);
          for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), c));
        }
      }
      const __m512 l_old = _mm512_maskz_loadu_ps(live, sc.l.data() + r0);
      _mm512_mask_storeu_ps(sc.l.data() + r0, live, _mm512_fmadd_ps(l_old, corr, sum_lanes_16(sums)));
      _mm512_mask_storeu_ps(sc.m.data() + r0, live, m_new);
    }
    for (int u = 0; u < key_runs; ++u) {  // V: keys 2i, 2i+1 of run u, columns 16c.. at vt[((u * D/16 + c) * 16 + i) * 16]
      for (int i = 0; i < 16; ++i) {
        const C* even = vrows[32 * u + 2 * i];
        const C* odd = vrows[32 * u + 2 * i + 1];
        for (int c = 0; c < D / 16; ++c) {
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + 16 * c)));
          const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + 16 * c)));
          _mm512_storeu_si512(vt + ((u * (D / 16) + c) * 16 + i) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
    constexpr int kGroup = D / 16 < 4 ? D / 16 : 4;  // column tiles of o accumulated together
    for (int64_t b = 0; b < blocks; ++b) {  // o[rows 16b.., columns 16c..] += P . V
      for (int c0 = 0; c0 < D / 16; c0 += kGroup) {
        float* ob = o + b * 16 * D + 16 * c0;
        _tile_loadd(0, ob, D * sizeof(float));
        if (kGroup > 1) _tile_loadd(1, ob + 16, D * sizeof(float));
        if (kGroup > 2) {
          _tile_loadd(2, ob + 32, D * sizeof(float));
          _tile_loadd(3, ob + 48, D * sizeof(float));
        }
        for (int u = 0; u < key_runs; ++u) {
          _tile_loadd(4, probs + b * 16 * kAmxKeys + 32 * u, kAmxKeys * sizeof(uint16_t));  // once per group
          const uint32_t* v = vt + (u * (D / 16) + c0) * 256;
          multiply_into(0, v);
          if (kGroup > 1) multiply_into(1, v + 256);
          if (kGroup > 2) {
            multiply_into(2, v + 512);
            multiply_into(3, v + 768);
          }
        }
        _tile_stored(0, ob, D * sizeof(float));
        if (kGroup > 1) _tile_stored(1, ob + 16, D * sizeof(float));
        if (kGroup > 2) {
          _tile_stored(2, ob + 32, D * sizeof(float));
          _tile_stored(3, ob + 48, D * sizeof(float));
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = p.out + ((q_begin + item.token_begin + r / group) * p.num_heads + h * group + r % group) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / sc.l[r]);
    for (int c = 0; c < NC; ++c) store_f32(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), inv));
  }
}

}  // namespace pagedllm_attention
#endif  // PAGEDLLM_AMX
