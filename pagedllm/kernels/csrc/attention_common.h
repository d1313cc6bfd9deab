// What the attention kernels share (paged_attention.cpp includes it, then the kernel headers): the
// tile sizes, lane folds and transposes, a work item, per-thread scratch, the AMX tile products and
// the Problem one call describes.
#pragma once

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
#include "attention_plan.h"
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


namespace pagedllm_attention {
using namespace pagedllm_vec;
using namespace pagedllm_amx;


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

constexpr int kMaxHeadDim = 256;
// Stands in for missing rows (zero is 0 bits in every dtype the cache holds).
alignas(64) const float kZeroRow[kMaxHeadDim] = {};

constexpr int kAmxKeys = 64;   // keys per online-softmax update on the AMX path (4 tiles of 16)
static_assert(kAmxKeys == 64, "run_item_amx multiplies exactly 4 key tiles per update");
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

constexpr int kTiledRows = 8;  // row block of the transposed-K score loop

#ifdef __AVX512BF16__
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

}  // namespace pagedllm_attention
