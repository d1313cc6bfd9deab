// Paged attention for CPUs with AVX-512: reads K/V in place through the block table (no gathered
// copy), one online softmax per query row, prefill chunks and decodes of many requests in one call.
//
// Layout (as pagedllm.attention allocates it): key_cache/value_cache [num_blocks, block_size,
// num_kv_heads, head_dim]; query/out [T, num_heads, head_dim]; request b's new tokens are rows
// query_start_loc[b] .. query_start_loc[b+1] and it has seq_lens[b] tokens in context.
//
// Work is cut into items (request, tile of up to kQueryTile new tokens, kv head). An item's rows are
// its tokens x the query heads sharing that kv head (GQA), so each K/V row is read once for all of
// them. Keys go by in tiles of 16: scores as 16-lane dot products folded by a transpose-add tree,
// then the online softmax update and P.V, all in fp32. Threads take items from a shared counter,
// longest first, through ATen's thread pool (torch.set_num_threads applies).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kKeyTile = 16;    // keys per tile: one 512-bit register of fp32 scores
constexpr int kQueryTile = 16;  // new tokens per work item (prefill chunks are cut into these)
constexpr float kNoScore = -1e30f;  // running max before any key: finite, so no inf - inf

inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_f32(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store_f32(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as torch does when casting float32 to bfloat16.
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// exp(x) for x <= 0 (scores minus their running max); exactly 0 below about -87.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 alive = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  // exp(r) for |r| <= ln2/2: Taylor to degree 7, relative error below 1e-8.
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(alive, _mm512_scalef_ps(p, n));
}

// Lane j of the result is the sum of the 16 lanes of v[j].
inline __m512 sum_lanes_16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: partials of v[2i]; 8-15: of v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit chunk k: 4 partials of v[4i + k]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // chunk k: 2 partials of v[8i + k], then 2 of v[8i + 4 + k]
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // chunk k: [v[k], v[k], v[4+k], v[4+k]] summed pairwise; then interleave with v[8+..].
  __m512 lo = _mm512_add_ps(c[0], _mm512_permute_ps(c[0], 0xB1));
  __m512 hi = _mm512_add_ps(c[1], _mm512_permute_ps(c[1], 0xB1));
  // Lane 4k + l now holds: l=0 v[k], l=1 v[8+k], l=2 v[4+k], l=3 v[12+k].
  __m512 mixed = _mm512_mask_blend_ps(0xAAAA, lo, hi);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, mixed);
}

struct WorkItem {
  int64_t seq;
  int64_t token_begin;  // first new token of the tile, counted within the request's new tokens
  int64_t num_tokens;
  int64_t kv_head;
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, o, s, k, v, m, l;
  void reserve(int64_t rows, int64_t head_dim) {
    q.resize(rows * head_dim);
    o.resize(rows * head_dim);
    s.resize(rows * kKeyTile);
    k.resize(kKeyTile * head_dim);
    v.resize(kKeyTile * head_dim);
    m.resize(rows);
    l.resize(rows);
  }
};

template <typename T>
struct Problem {
  const T* query;
  const T* key_cache;
  const T* value_cache;
  T* out;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t table_stride, block_size, num_heads, num_kv_heads, head_dim, sliding_window;
  float scale;
};

template <typename T>
void run_item(const Problem<T>& p, const WorkItem& item, Scratch& sc) {
  const int64_t D = p.head_dim, group = p.num_heads / p.num_kv_heads;
  const int64_t rows = item.num_tokens * group, h = item.kv_head;
  const int64_t q_begin = p.query_start_loc[item.seq], q_len = p.query_start_loc[item.seq + 1] - q_begin;
  const int64_t ctx_len = p.seq_lens[item.seq];
  const int64_t first_pos = ctx_len - q_len + item.token_begin;  // absolute position of row 0's token
  const int64_t last_pos = first_pos + item.num_tokens - 1;
  const int64_t key_end = last_pos + 1;
  const int64_t key_begin = p.sliding_window > 0 ? std::max<int64_t>(0, first_pos - p.sliding_window + 1) : 0;
  const int32_t* table = p.block_tables + item.seq * p.table_stride;
  const int64_t row_stride = p.num_kv_heads * D;  // between consecutive tokens of one kv head

  sc.reserve(rows, D);
  float *q = sc.q.data(), *o = sc.o.data(), *s = sc.s.data(), *kf = sc.k.data(), *vf = sc.v.data();
  float *m = sc.m.data(), *l = sc.l.data();
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t r = 0; r < rows; ++r) {  // row r: token r / group, query head h * group + r % group
    const T* src = p.query + ((q_begin + item.token_begin + r / group) * p.num_heads + h * group + r % group) * D;
    for (int64_t d = 0; d < D; d += 16) {
      store_f32(q + r * D + d, _mm512_mul_ps(load_f32(src + d), scale));
      store_f32(o + r * D + d, _mm512_setzero_ps());
    }
    m[r] = kNoScore;
    l[r] = 0.0f;
  }

  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, key_end - k0));
    for (int j = 0; j < kKeyTile; ++j) {  // this tile's K/V rows in fp32; zeros past the end
      if (j < n) {
        const int64_t pos = k0 + j;
        const int64_t slot = static_cast<int64_t>(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
        const T* krow = p.key_cache + slot * row_stride + h * D;
        const T* vrow = p.value_cache + slot * row_stride + h * D;
        for (int64_t d = 0; d < D; d += 16) {
          store_f32(kf + j * D + d, load_f32(krow + d));
          store_f32(vf + j * D + d, load_f32(vrow + d));
        }
      } else {
        for (int64_t d = 0; d < D; d += 16) {
          store_f32(kf + j * D + d, _mm512_setzero_ps());
          store_f32(vf + j * D + d, _mm512_setzero_ps());
        }
      }
    }
    // Keys of this tile that some row must not see: past the end, after a row's own position
    // (causal), or out of a row's sliding window.
    const bool needs_mask = n < kKeyTile || k0 + n - 1 > first_pos ||
                            (p.sliding_window > 0 && k0 <= last_pos - p.sliding_window);
    const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int64_t r = 0; r < rows; ++r) {
      __m512 partial[kKeyTile];
      for (int j = 0; j < kKeyTile; ++j) partial[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = load_f32(q + r * D + d);
        for (int j = 0; j < kKeyTile; ++j) partial[j] = _mm512_fmadd_ps(qv, load_f32(kf + j * D + d), partial[j]);
      }
      __m512 scores = sum_lanes_16(partial);
      if (needs_mask) {
        const int64_t pos = first_pos + r / group;
        __mmask16 visible = _mm512_cmp_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(pos)), _MM_CMPINT_LE);
        if (p.sliding_window > 0) {
          visible &= _mm512_cmp_epi32_mask(key_pos, _mm512_set1_epi32(static_cast<int>(pos - p.sliding_window)),
                                           _MM_CMPINT_GT);
        }
        visible &= static_cast<__mmask16>((1u << n) - 1);
        scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, scores);
      }
      // Online softmax: rescale what was accumulated to the new running max.
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(scores));
      const __m512 probs = exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(m_new)));
      const float correction = std::exp(m[r] - m_new);
      l[r] = l[r] * correction + _mm512_reduce_add_ps(probs);
      m[r] = m_new;
      _mm512_storeu_ps(s + r * kKeyTile, probs);
      const __m512 corr = _mm512_set1_ps(correction);
      for (int64_t d = 0; d < D; d += 16) {
        __m512 acc = _mm512_mul_ps(load_f32(o + r * D + d), corr);
        for (int j = 0; j < n; ++j) {
          acc = _mm512_fmadd_ps(_mm512_set1_ps(s[r * kKeyTile + j]), load_f32(vf + j * D + d), acc);
        }
        store_f32(o + r * D + d, acc);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = p.out + ((q_begin + item.token_begin + r / group) * p.num_heads + h * group + r % group) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t d = 0; d < D; d += 16) store_f32(dst + d, _mm512_mul_ps(load_f32(o + r * D + d), inv));
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t num_seqs) {
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = p.query_start_loc[b + 1] - p.query_start_loc[b];
    const int64_t ctx_len = p.seq_lens[b];
    for (int64_t t = 0; t < q_len; t += kQueryTile) {
      const int64_t n = std::min<int64_t>(kQueryTile, q_len - t);
      int64_t keys = ctx_len - q_len + t + n;
      if (p.sliding_window > 0) keys = std::min(keys, p.sliding_window + n);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({b, t, n, h, keys * n});
    }
  }
  // Longest first, so the last items to start are short ones and threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) run_item(p, items[i], scratch);
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_attention: query [T, Hq, D], caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "paged_attention: query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_attention: int32 metadata");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim % 16 == 0 && key_cache.size(3) == head_dim, "paged_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv heads");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  at::Tensor out = at::empty_like(query);
  const int64_t num_seqs = lens.size(0);
  if (num_seqs == 0 || query.size(0) == 0) return out;

  auto dispatch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Problem<T> p{query.const_data_ptr<T>(), key_cache.const_data_ptr<T>(), value_cache.const_data_ptr<T>(),
                 out.mutable_data_ptr<T>(), tables.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(),
                 starts.const_data_ptr<int32_t>(), tables.dim() == 2 ? tables.size(1) : 0, key_cache.size(1),
                 query.size(1), key_cache.size(2), head_dim, sliding_window, static_cast<float>(scale)};
    run(p, num_seqs);
  };
  if (query.scalar_type() == at::kFloat) {
    dispatch(static_cast<float*>(nullptr));
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
