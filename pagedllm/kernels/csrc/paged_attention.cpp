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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {
using namespace pagedllm_vec;
using namespace pagedllm_amx;

constexpr int kKeyTile = 16;    // keys per tile: one 512-bit register of fp32 scores
constexpr int kQueryTile = 16;  // new tokens per work item (prefill chunks are cut into these)
constexpr float kNoScore = -1e30f;  // running max before any key: finite, so no inf - inf

// Lane j of the result is op over the 16 lanes of v[j] (op: _mm512_add_ps or _mm512_max_ps):
// 16 horizontal folds in one transpose-like tree.
template <__m512 (*op)(__m512, __m512)>
inline __m512 fold_lanes_16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: partials of v[2i]; 8-15: of v[2i+1]
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit chunk k: 4 partials of v[4i + k]
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // chunk k: 2 partials of v[8i + k], then 2 of v[8i + 4 + k]
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // chunk k: [v[k], v[k], v[4+k], v[4+k]] folded pairwise; then interleave with v[8+..].
  __m512 lo = op(c[0], _mm512_permute_ps(c[0], 0xB1));
  __m512 hi = op(c[1], _mm512_permute_ps(c[1], 0xB1));
  // Lane 4k + l now holds: l=0 v[k], l=1 v[8+k], l=2 v[4+k], l=3 v[12+k].
  __m512 mixed = _mm512_mask_blend_ps(0xAAAA, lo, hi);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, mixed);
}

inline __m512 add_ps(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 max_ps(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 sum_lanes_16(const __m512 v[16]) { return fold_lanes_16<add_ps>(v); }

// dst[k][j] = rows[j][k] for a 16 x cols tile of 32-bit elements (cols <= 16; dst rows 16 apart).
// Rows j >= 16 are not read; dst rows k >= cols are not written.
inline void transpose_16x16(const float* const* rows, int64_t offset, int cols, float* dst) {
  __m512 r[16], t[16];
  const __mmask16 m = tail_mask(cols);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(m, rows[i] + offset);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {  // column k is shuffle(t[k % 8], t[k % 8 + 8]), low or high half
    if (i < cols) _mm512_storeu_ps(dst + i * 16, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    if (i + 8 < cols) _mm512_storeu_ps(dst + (i + 8) * 16, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
  }
}

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

struct WorkItem {
  int64_t seq;
  int64_t token_begin;  // first new token of the item, counted within the request's new tokens
  int64_t num_tokens;
  int64_t head_begin, num_heads;  // kv heads
  int64_t cost;
};

constexpr int kMaxHeadDim = 256;
// Stands in for missing rows (zero is 0 bits in every dtype the cache holds).
alignas(64) const float kZeroRow[kMaxHeadDim] = {};

constexpr int kAmxKeys = 64;   // keys per online-softmax update on the AMX path (4 tiles of 16)
static_assert(kAmxKeys == 64, "run_item_amx multiplies exactly 4 key tiles per update");
constexpr int kAmxRows = 192;   // rows (tokens x the query heads of a kv head) an AMX item aims for
constexpr int kPrefetchTiles = 1;  // how far ahead (in tiles of 16 keys) a decode on the tile unit asks for K/V

struct Scratch {
  std::vector<float> o, m, l, corr, probs, k, kt, v, q;
  // The AMX path's: Q rows and probabilities in bf16, K^T and V as bf16 pairs (32-bit units).
  std::vector<uint16_t> qb, pb;
  std::vector<uint32_t> kp, vp;
  void reserve(int64_t heads, int64_t rows, int64_t head_dim) {
    o.resize(heads * rows * head_dim);
    q.resize(heads * rows * head_dim);
    m.resize(heads * rows);
    l.resize(heads * rows);
    corr.resize(rows);
    probs.resize(rows * kKeyTile);
    k.resize(kKeyTile * head_dim);
    kt.resize(kKeyTile * head_dim);
    v.resize(kKeyTile * head_dim);
  }
  void reserve_amx(int64_t rows, int64_t head_dim) {
    o.resize(rows * head_dim);
    m.resize(rows);
    l.resize(rows);
    probs.resize(rows * kAmxKeys);
    qb.resize(rows * head_dim);
    pb.assign(rows * kAmxKeys, 0);  // padding rows stay zero: they add nothing to P.V
    kp.resize(kAmxKeys * head_dim / 2);
    vp.resize(kAmxKeys * head_dim / 2);
  }
};

#ifdef PAGEDLLM_AMX
// Accumulator tile j (0-3) += tile 4 (A) x the B tile at b (rows 64 bytes apart), loaded into
// tile 5 or 6 by j's parity so that a load does not wait for the product before it to read its
// tile (tiles are not renamed). The intrinsics take tile numbers as literals (they are spelled
// into the instruction), hence the switch; every call passes a constant, so it folds away.
inline void multiply_into(int j, const void* b) {
  switch (j) {
    case 0: _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_loadd(6, b, 64); _tile_dpbf16ps(1, 4, 6); break;
    case 2: _tile_loadd(5, b, 64); _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_loadd(6, b, 64); _tile_dpbf16ps(3, 4, 6); break;
  }
}
#endif

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
constexpr int kTiledRows = 8;  // row block of the transposed-K score loop

#ifdef __AVX512BF16__
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

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
          _mm_prefetch(ahead->k + j * ahead->stride + b, _MM_HINT_T0);
          _mm_prefetch(ahead->v + j * ahead->stride + b, _MM_HINT_T0);
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
  // One item on the tile unit: its rows (tokens x the query heads of kv head item.head_begin), keys
  // 64 at a time. Tiles 0-2: accumulator, A (Q or P rows), B (K^T or V as bf16 pairs).
  static void run_item_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
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

  // Whether a decode item (one new token) can take run_decode_amx: key tiles of 16 never cross a
  // block, and a kv head's query heads fit the 16 columns of a score tile.
  static bool decode_fits_amx(const Problem<T, C>& p, const WorkItem& item) {
    return item.num_tokens == 1 && p.block_size % kKeyTile == 0 && p.num_heads / p.num_kv_heads <= 16;
  }

  // Asks for the nh heads (from row) of 16 consecutive cache rows, token_stride apart, in L1.
  static void prefetch_rows(const C* row, int64_t nh, int64_t token_stride) {
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
  static void run_decode_amx(const Problem<T, C>& p, const WorkItem& item, Scratch& sc) {
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
      {  // The next tile's rows (all the item's heads) start coming from memory now: decodes
         // read their KV once, in scattered blocks, and this makes them 1.4x faster from DRAM.
        const int64_t ahead = k0 + kKeyTile;
        const int64_t bytes = item.num_heads * D * static_cast<int64_t>(sizeof(C));
        for (int64_t pos = ahead; pos < std::min(ahead + kKeyTile, key_end); ++pos) {
          const int64_t slot = p.slot(table, pos);
          const char* kp = reinterpret_cast<const char*>(p.key_cache + slot * token_stride + item.head_begin * D);
          const char* vp = reinterpret_cast<const char*>(p.value_cache + slot * token_stride + item.head_begin * D);
          for (int64_t b = 0; b < bytes; b += 64) { _mm_prefetch(kp + b, _MM_HINT_T0); _mm_prefetch(vp + b, _MM_HINT_T0); }
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
          accumulate_pv(o, rows, sc.corr.data(), probs, kKeyTile, 1, vrows, kKeyTile);
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

// Calls f(tag) with a null pointer of the C++ type for a float32 or bfloat16 tensor's dtype.
template <typename F>
void dispatch_model_dtype(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (dtype == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, what, ": float32 or bfloat16 only");
  }
}

// The same for a compressed cache's codes: int8, fp8 e4m3 or fp8 e5m2.
template <typename F>
void dispatch_code_dtype(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kChar) {
    f(static_cast<int8_t*>(nullptr));
  } else if (dtype == at::kFloat8_e4m3fn) {
    f(static_cast<c10::Float8_e4m3fn*>(nullptr));
  } else if (dtype == at::kFloat8_e5m2) {
    f(static_cast<c10::Float8_e5m2*>(nullptr));
  } else {
    TORCH_CHECK(false, what, ": the cache holds the query's dtype, int8, float8_e4m3fn or float8_e5m2");
  }
}

// Optional per-token-and-head scales of a cache: fp16 [blocks, block_size, Hkv], contiguous.
void check_scale(const std::optional<at::Tensor>& scale, const at::Tensor& cache, const char* what) {
  TORCH_CHECK(!scale.has_value() || (scale->scalar_type() == at::kHalf && scale->is_contiguous() &&
                                     scale->dim() == 3 && scale->size(0) == cache.size(0) &&
                                     scale->size(1) == cache.size(1) && scale->size(2) == cache.size(2)),
              what, ": scales are float16 [blocks, block_size, Hkv], contiguous");
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

// A code's largest magnitude, and x (already divided by the scale) as a code: int8 rounds half
// to even and clamps; fp8 clamps to its largest finite value and rounds to nearest even.
inline float max_code(const int8_t*) { return 127.0f; }
template <typename F8>
float max_code(const F8*) { return static_cast<float>(std::numeric_limits<F8>::max()); }

inline int8_t to_code(float x, const int8_t* tag) {
  return static_cast<int8_t>(std::clamp(std::nearbyint(x), -max_code(tag), max_code(tag)));
}
template <typename F8>
F8 to_code(float x, const F8* tag) { return F8(std::clamp(x, -max_code(tag), max_code(tag))); }

// One token's head x[0..n) as codes and their fp16 scale, exactly as kv_quant.quantize does:
// scale = max |x| / max_code rounded up to fp16, code = x / scale (the stored scale) as a code.
template <typename T, typename C>
void quantize_row(const T* x, C* codes, c10::Half* scale, int64_t n) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[i])));
  const float exact = absmax / max_code(codes);
  c10::Half stored = exact;
  if (static_cast<float>(stored) < exact) stored = c10::Half(stored.x + 1, c10::Half::from_bits());  // next up
  *scale = stored;
  const float s = static_cast<float>(stored);
  for (int64_t i = 0; i < n; ++i) codes[i] = s > 0.0f ? to_code(static_cast<float>(x[i]) / s, codes) : C(0);
}

// key_cache/value_cache viewed as [slots, Hkv * D]: row slot_mapping[t] = key[t] / value[t]. Each
// token's K and V are one contiguous row wherever they sit (e.g. views into the fused q/k/v rows).
// A compressed cache gets each token's heads quantized, with their scales.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "write_kv: key/value [T, Hkv, D] with each token's heads contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2) &&
                  key_cache.sizes() == value_cache.sizes(),
              "write_kv: caches [blocks, block_size, Hkv, D] matching key/value");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv: key and value share a dtype, and so do the caches");
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), "write_kv: scales for both caches or neither");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0),
              "write_kv: int64 slot_mapping, one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "write_kv: slot ", sp[t], " out of range");
  }
  if (key.scalar_type() == key_cache.scalar_type()) {  // the model's dtype: copy the rows
    TORCH_CHECK(!key_scale.has_value(), "write_kv: scales belong to compressed caches");
    const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
    const char* kp = static_cast<const char*>(key.const_data_ptr());
    const char* vp = static_cast<const char*>(value.const_data_ptr());
    char* kc = static_cast<char*>(key_cache.mutable_data_ptr());
    char* vc = static_cast<char*>(value_cache.mutable_data_ptr());
    const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
    // From 16 rows on, both cores: each row's lines are write-allocated from DRAM (fresh slots).
    at::parallel_for(0, key.size(0), 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        std::memcpy(kc + sp[t] * row_bytes, kp + t * ks, row_bytes);
        std::memcpy(vc + sp[t] * row_bytes, vp + t * vs, row_bytes);
      }
    });
    return;
  }
  TORCH_CHECK(key_scale.has_value(), "write_kv: a compressed cache needs its scales");
  check_scale(key_scale, key_cache, "write_kv");
  check_scale(value_scale, value_cache, "write_kv");
  c10::Half* kscale = key_scale->mutable_data_ptr<c10::Half>();
  c10::Half* vscale = value_scale->mutable_data_ptr<c10::Half>();
  const int64_t heads = key.size(1), head_dim = key.size(2);
  dispatch_model_dtype(key.scalar_type(), "write_kv", [&](auto* key_tag) {
    using T = std::remove_pointer_t<decltype(key_tag)>;
    dispatch_code_dtype(key_cache.scalar_type(), "write_kv", [&](auto* cache_tag) {
      using C = std::remove_pointer_t<decltype(cache_tag)>;
      const T* kp = key.const_data_ptr<T>();
      const T* vp = value.const_data_ptr<T>();
      C* kc = key_cache.mutable_data_ptr<C>();
      C* vc = value_cache.mutable_data_ptr<C>();
      at::parallel_for(0, key.size(0), 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t row = sp[t] * heads + h;  // (slot, head) in the cache
            quantize_row(kp + t * key.stride(0) + h * head_dim, kc + row * head_dim, kscale + row, head_dim);
            quantize_row(vp + t * value.stride(0) + h * head_dim, vc + row * head_dim, vscale + row, head_dim);
          }
        }
      });
    });
  });
}

}  // namespace

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

namespace {

// Brings every page of the listed blocks of each cache tensor (dim 0: blocks, contiguous) into
// the process, keeping what they hold (a byte per page gets 0 added). Faulting a
// step's new blocks in here, in one parallel pass, costs a fraction of what the same faults cost
// one at a time inside the model's parallel kernels (where a fault on one core stalls both).
void touch_blocks(const std::vector<at::Tensor>& caches, const at::Tensor& block_ids) {
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "touch_blocks: block_ids must be a contiguous int64 vector");
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() && cache.dim() >= 1,
                "touch_blocks: each cache must be a contiguous CPU tensor of blocks");
  }
  const int64_t* ids = block_ids.const_data_ptr<int64_t>();
  const int64_t num_ids = block_ids.numel();
  for (int64_t i = 0; i < num_ids; ++i) {
    for (const at::Tensor& cache : caches) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < cache.size(0), "touch_blocks: block ", ids[i], " out of range");
    }
  }
  constexpr uintptr_t kPage = 4096;
  const int64_t num_caches = static_cast<int64_t>(caches.size());
  at::parallel_for(0, num_caches * num_ids, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const at::Tensor& cache = caches[w / num_ids];
      const int64_t row_bytes = cache.stride(0) * static_cast<int64_t>(cache.element_size());
      char* first = static_cast<char*>(cache.data_ptr()) + ids[w % num_ids] * row_bytes;
      const uintptr_t last = reinterpret_cast<uintptr_t>(first) + row_bytes;
      for (uintptr_t page = reinterpret_cast<uintptr_t>(first) & ~(kPage - 1); page < last; page += kPage) {
        // An atomic add of 0 is one write access: one fault per page, where a read then a write
        // would map the zero page first and fault again to replace it.
        __atomic_fetch_add(reinterpret_cast<char*>(std::max(page, reinterpret_cast<uintptr_t>(first))), 0,
                           __ATOMIC_RELAXED);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("attention_amx_available", &attention_amx_available);
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale, "
        "Tensor? value_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, float softcap, bool use_amx) -> Tensor");
  m.def("paged_attention_invariant(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale, "
        "Tensor? value_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, float softcap) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!)? key_scale, "
        "Tensor(d!)? value_scale, Tensor slot_mapping) -> ()");
  m.def("touch_blocks(Tensor[] caches, Tensor block_ids) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_invariant", &paged_attention_invariant);
  m.impl("write_kv", &write_kv);
  m.impl("touch_blocks", &touch_blocks);
}
