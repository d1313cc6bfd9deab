// Paged attention for the AVX2 tier (AVX2, FMA, F16C): the same ops, layout and work items as the
// AVX-512 kernel (paged_attention.cpp says both), on 8-lane fp32 vectors. Per work item and kv
// head: the query rows in fp32, then keys in tiles of kKeyTile at absolute multiples of it (a
// row's sums run in one order whatever shares its item: batch-invariant by construction, so
// row_invariant changes nothing here). Per tile: each row's scores as 8-key groups of dot products
// folded by one hadd tree, the key scales and the softmax scale, the soft cap, the causal and
// window mask, the online softmax update, then P.V, all in fp32. Compressed K/V tiles are turned
// to fp32 once per tile where more than one row reads them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_plan.h"
#include "ops.h"
#include "vec_avx2.h"

namespace pagedllm_attention {
namespace {
using namespace pagedllm_vec_avx2;


// Lane j: the sum of a[j]'s lanes.
inline __m256 fold8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float fp16_to_float(c10::Half h) { return static_cast<float>(h); }

struct Scratch {
  std::vector<float> q, o, m, l, corr, probs, kf, vf;
  void reserve(int64_t rows, int64_t head_dim) {
    q.resize(rows * head_dim);
    o.resize(rows * head_dim);
    m.resize(rows);
    l.resize(rows);
    corr.resize(rows);
    probs.resize(rows * kKeyTile);
    kf.resize(kKeyTile * head_dim);
    vf.resize(kKeyTile * head_dim);
  }
};

template <typename T, typename C, int D>
struct Kernel {
  static constexpr int NC = D / 8;  // 256-bit fp32 chunks per row
  static_assert(D % 8 == 0, "head_dim must be a multiple of 8");

  // The 16 rows of a tile in fp32 (kf[j * D ...]).
  static void tile_to_f32(const C* const* rows, float* kf) {
    for (int j = 0; j < kKeyTile; ++j) {
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(kf + j * D + c * 8, load8(rows[j] + c * 8));
    }
  }

  // scores[j] = q . k[j] for the 16 keys of a tile (K rows of type S: the cache's, or fp32).
  template <typename S>
  static void scores_row(const float* q, const S* const* krows, float* scores) {
    __m256 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(q + c * 8);
    for (int g = 0; g < kKeyTile; g += 8) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) {
        __m256 a = _mm256_mul_ps(qv[0], load8(krows[g + j]));
        for (int c = 1; c < NC; ++c) a = _mm256_fmadd_ps(qv[c], load8(krows[g + j] + c * 8), a);
        acc[j] = a;
      }
      _mm256_storeu_ps(scores + g, fold8(acc));
    }
  }

  // o = o * corr + sum_j probs[j] v[j] over a tile's 16 keys (V rows of type S; weight 0 past the end).
  template <typename S>
  static void pv_row(float* o, float corr, const float* probs, const S* const* vrows) {
    constexpr int kBlock = NC < 8 ? NC : 8;  // chunks kept in registers at once
    for (int c0 = 0; c0 < NC; c0 += kBlock) {
      __m256 acc[kBlock];
      const __m256 cv = _mm256_set1_ps(corr);
      for (int c = 0; c < kBlock; ++c) acc[c] = _mm256_mul_ps(_mm256_loadu_ps(o + (c0 + c) * 8), cv);
      for (int j = 0; j < kKeyTile; ++j) {
        const __m256 pj = _mm256_set1_ps(probs[j]);
        for (int c = 0; c < kBlock; ++c) acc[c] = _mm256_fmadd_ps(pj, load8(vrows[j] + (c0 + c) * 8), acc[c]);
      }
      for (int c = 0; c < kBlock; ++c) _mm256_storeu_ps(o + (c0 + c) * 8, acc[c]);
    }
  }

  static void run_item(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
    const int64_t group = p.num_heads / p.num_kv_heads;
    const int64_t rows = item.num_tokens * group;  // per kv head: token r / group, query head r % group
    const int64_t q_begin = p.query_start_loc[item.seq];
    const int64_t q_len = p.query_start_loc[item.seq + 1] - q_begin;
    const int64_t first_pos = p.seq_lens[item.seq] - q_len + item.token_begin;  // of the item's first token
    const int64_t last_pos = first_pos + item.num_tokens - 1;
    // The first key any row sees; tiles start at multiples of kKeyTile, and the keys of the first
    // tile before it are never read (their blocks may be gone: -1 in the table) and masked.
    const int64_t first_key = p.sliding_window > 0 ? std::max<int64_t>(0, first_pos - p.sliding_window + 1) : 0;
    const int64_t key_begin = first_key - first_key % kKeyTile;
    const int64_t key_end = last_pos + 1;
    const int32_t* table = p.block_tables + item.seq * p.table_stride;
    const int64_t token_stride = p.num_kv_heads * D;
    // More than one row reads each K/V row of a tile: turn compressed or bf16 rows to fp32 once.
    const bool convert = !std::is_same_v<C, float> && rows > 1;
    sc.reserve(rows, D);
    alignas(32) static const float zero_row[256] = {};
    static_assert(D <= 256, "zero_row covers the largest head_dim");

    for (int64_t hh = 0; hh < item.num_heads; ++hh) {
      const int64_t h = item.head_begin + hh;
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = p.query + (q_begin + item.token_begin + r / group) * p.query_stride + (h * group + r % group) * D;
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(sc.q.data() + r * D + c * 8, load8(row + c * 8));
      }
      std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      std::fill(sc.m.begin(), sc.m.end(), kNoScore);
      std::fill(sc.l.begin(), sc.l.end(), 0.0f);
      int64_t slots[kKeyTile];
      const C* krows[kKeyTile];
      const C* vrows[kKeyTile];
      const float* kf_rows[kKeyTile];
      const float* vf_rows[kKeyTile];
      alignas(32) float key_factor[kKeyTile], value_factor[kKeyTile];
      alignas(32) float scores[kKeyTile];
      for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
        const int n = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - k0));
        for (int j = 0; j < kKeyTile; ++j) {
          const bool read = j < n && k0 + j >= first_key;
          slots[j] = read ? p.slot(table, k0 + j) : 0;
          krows[j] = read ? p.key_cache + slots[j] * token_stride + h * D : reinterpret_cast<const C*>(zero_row);
          vrows[j] = read ? p.value_cache + slots[j] * token_stride + h * D : reinterpret_cast<const C*>(zero_row);
          kf_rows[j] = sc.kf.data() + j * D;
          vf_rows[j] = sc.vf.data() + j * D;
          key_factor[j] = p.scale;
          value_factor[j] = 1.0f;
          if (p.key_scale != nullptr && read) {
            key_factor[j] *= fp16_to_float(p.key_scale[slots[j] * p.num_kv_heads + h]);
            value_factor[j] = fp16_to_float(p.value_scale[slots[j] * p.num_kv_heads + h]);
          }
        }
        for (int64_t pos = k0 + kKeyTile; pos < std::min(k0 + 2 * kKeyTile, key_end); ++pos) {
          // The next tile's rows start coming from memory while this one computes: into L2, not
          // L1, whose few miss buffers capped the lines in flight (the AVX-512 kernel's reason;
          // this kernel on ep-2c, --cpu-isa avx2, caches from DRAM: 16 decodes 1.7-2.1x faster,
          // one stream at 1,000 keys 1.5-3x, 16 five-token verifications 1.1-1.5x).
          const int64_t slot = p.slot(table, pos);
          const char* kp = reinterpret_cast<const char*>(p.key_cache + slot * token_stride + h * D);
          const char* vp = reinterpret_cast<const char*>(p.value_cache + slot * token_stride + h * D);
          for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(C)); b += 64) {
            _mm_prefetch(kp + b, _MM_HINT_T1);
            _mm_prefetch(vp + b, _MM_HINT_T1);
          }
        }
        if (convert) {
          tile_to_f32(krows, sc.kf.data());
          tile_to_f32(vrows, sc.vf.data());
        }
        const bool needs_mask = n < kKeyTile || k0 + n - 1 > first_pos ||
                                (p.sliding_window > 0 && k0 <= last_pos - p.sliding_window);
        for (int64_t r = 0; r < rows; ++r) {
          if (convert) {
            scores_row(sc.q.data() + r * D, kf_rows, scores);
          } else {
            scores_row(sc.q.data() + r * D, krows, scores);
          }
          const int64_t pos = first_pos + r / group;
          __m256 s[2];
          for (int g = 0; g < 2; ++g) {
            s[g] = _mm256_mul_ps(_mm256_loadu_ps(scores + 8 * g), _mm256_loadu_ps(key_factor + 8 * g));
            if (p.softcap > 0) {
              const __m256 cap = _mm256_set1_ps(p.softcap);
              s[g] = _mm256_mul_ps(cap, tanh8(_mm256_mul_ps(s[g], _mm256_set1_ps(1.0f / p.softcap))));
            }
          }
          if (needs_mask) {  // keys past the end, after the row's position (causal) or out of its window
            _mm256_storeu_ps(scores, s[0]);
            _mm256_storeu_ps(scores + 8, s[1]);
            for (int j = 0; j < kKeyTile; ++j) {
              const int64_t key = k0 + j;
              const bool visible = j < n && key <= pos && (p.sliding_window <= 0 || key > pos - p.sliding_window);
              if (!visible) scores[j] = -INFINITY;
            }
            s[0] = _mm256_loadu_ps(scores);
            s[1] = _mm256_loadu_ps(scores + 8);
          }
          // Online softmax: what was accumulated is rescaled to the new running max.
          float& m = sc.m[r];
          const float m_new = std::max(m, hmax(_mm256_max_ps(s[0], s[1])));
          const __m256 mv = _mm256_set1_ps(m_new);
          const __m256 e0 = exp8(_mm256_sub_ps(s[0], mv)), e1 = exp8(_mm256_sub_ps(s[1], mv));
          const float corr = std::exp(m - m_new);
          sc.l[r] = sc.l[r] * corr + hsum(_mm256_add_ps(e0, e1));
          m = m_new;
          float* probs = sc.probs.data() + r * kKeyTile;
          _mm256_storeu_ps(probs, _mm256_mul_ps(e0, _mm256_loadu_ps(value_factor)));
          _mm256_storeu_ps(probs + 8, _mm256_mul_ps(e1, _mm256_loadu_ps(value_factor + 8)));
          if (convert) {
            pv_row(sc.o.data() + r * D, corr, probs, vf_rows);
          } else {
            pv_row(sc.o.data() + r * D, corr, probs, vrows);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = p.out + ((q_begin + item.token_begin + r / group) * p.num_heads + h * group + r % group) * D;
        const float inv = 1.0f / sc.l[r];
        const float* o = sc.o.data() + r * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  }
};

template <typename T, typename C, int D>
void run(const Problem<T, C>& p, int64_t num_seqs) {
  // Each head is computed alike whatever item holds it: a decode of fewer streams than threads
  // takes an item per kv head.
  const std::vector<WorkItem> items = plan(p, num_seqs, false, at::get_num_threads());
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      Kernel<T, C, D>::run_item(p, items[i], scratch);
    }
  });
}

}  // namespace

template <typename T, typename C>
void run_problem(const Problem<T, C>& p, int64_t num_seqs, bool) {
  switch (p.head_dim) {
    case 16: return run<T, C, 16>(p, num_seqs);
    case 32: return run<T, C, 32>(p, num_seqs);
    case 64: return run<T, C, 64>(p, num_seqs);
    case 128: return run<T, C, 128>(p, num_seqs);
    case 256: return run<T, C, 256>(p, num_seqs);
    default: TORCH_CHECK(false, "paged_attention: head_dim ", p.head_dim, " is not compiled in");
  }
}

PAGEDLLM_INSTANTIATE_RUN_PROBLEM

bool attention_amx_available() { return false; }

}  // namespace pagedllm_attention
