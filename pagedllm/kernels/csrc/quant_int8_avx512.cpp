// The few-rows quantized matmul with int8 activations (quant_int8_rows.h) and AVX-512 VNNI's
// vpdpbusd (64 products of an unsigned and a signed byte, summed in fours into 16 int32 lanes):
// for bf16 activations, where a decode step's matmuls then run on integer dot products, as
// llama.cpp's do, instead of decoding weights to bf16 or fp32.
//
// Per 64 inputs (two blocks of 32) and weight row, the codes as unsigned bytes in x's order:
//  u4: the 32 bytes of two runs loaded twice (one broadcast load), the upper copy shifted to its
//      high nibbles, masked to 4 bits: codes 0..15, the codebook's u + c; x is laid out to match
//      (quant_int8_rows.h's nibble order), so no shuffle;
//  i8: the 64 codes with their sign bit flipped: u = w + 128, c = -128.
// Then per row of x: vpdpbusd started at c * (the codes' sums), exact in int32; converted to fp32,
// times each block's d and the weight group's scale, summed in fp32; the mins' term last.
//
// Row-interleaved weights (quant_int8_rows.h; what the loader gives a bf16 model at this tier) turn
// that around: a vector's 16 int32 lanes are 16 weight rows, each vpdpbusd takes 4 of x's codes
// broadcast, and a block's 16 sums need one conversion, one scale vector (16 rows' scales, one
// load) and one multiply-add, where the per-row kernel spends a permute, a conversion and two
// multiplies per row and pair of blocks, and a horizontal sum per row. About a third of the
// instructions per weight: 3x faster in cache, and a one-stream decode is then bound by memory.
// Groups of 16 rows go in pairs (interleaved_rows_pair): each broadcast of x's codes feeds both
// groups' products (1.02-1.12x the single group's speed over the default model's projections,
// ep-2c, 1-64 rows; the same results bit for bit).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "quant_int8_rows.h"
#include "quant_packed.h"

namespace pagedllm_int8 {
namespace {
using namespace pagedllm_quant;

#ifdef __AVX512VNNI__
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// The unsigned codes of a weight row for inputs 64p .. 64p+63 (single: the first 32 only), in x's
// order (u4: quant_int8_rows.h's nibble order; i8: as they lie).
template <bool kU4>
inline __m512i unsigned_codes(const uint8_t* row, int64_t p, bool single) {
  if constexpr (kU4) {
    const uint8_t* at = row + p * 32;
    // 128-bit lanes [run 0, run 1, run 0, run 1] (run 0 four times when single: x is zero past it),
    // the upper two shifted to their high nibbles.
    const __m512i twice = single ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))
                                 : _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    const __m512i high_down = _mm512_mask_srli_epi16(twice, 0xFFFF0000u, twice, 4);
    return _mm512_and_si512(high_down, _mm512_set1_epi8(0x0F));
  } else {
    const uint8_t* at = row + p * 64;
    const __m512i codes = single ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, at) : _mm512_loadu_si512(at);
    return _mm512_xor_si512(codes, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
}

// Groups of 32: which of a pair's two groups each lane holds (u4: runs of 16 alternate, in the
// nibble order; i8: lanes 0-7, 8-15), plus 2j for the j-th pair after the one whose first group
// starts the 16 loaded scales.
template <bool kU4>
inline __m512i pair_groups(int j) {
  const __m512i base = kU4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                           : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_add_epi32(base, _mm512_set1_epi32(2 * j));
}

// x's rows as the dot products read them.
struct RowsView {
  const int8_t* codes;
  const float* scales;
  const int32_t* offsets;  // nullptr: c = 0
  const float* sums;       // nullptr: no mins
  int64_t K_pad, groups;

  RowsView offset(int64_t m) const {
    const int64_t lanes = K_pad / kLane;
    return RowsView{codes + m * K_pad, scales + m * lanes, offsets ? offsets + m * lanes : nullptr,
                    sums ? sums + m * groups : nullptr, K_pad, groups};
  }
};

// acc[nr][r] = x[r] . w[n0 + nr] for NR weight rows and R rows of x. kG: 32, or 64 for any multiple
// of 64 (one group per pair, w.group_size the real one). Groups of 32 take 16 scales (8 pairs) per
// load, then one permute per pair.
template <int NR, int R, bool kU4, bool kMin, int kG, typename S>
inline void int8_dot(const Packed<S>& w, int64_t n0, const RowsView& x, float (&acc_out)[NR][R]) {
  const int64_t pairs = x.K_pad / 64, lanes = x.K_pad / kLane;
  const bool last_single = w.K % 64 != 0;
  __m512 acc[NR][R];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += 8) {
    __m512 loaded[NR];
    if constexpr (kG == 32) {
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i)
        loaded[i] = load_groups(w.scales + (n0 + i) * w.groups + 2 * p0, tail_mask(w.groups - 2 * p0));
    }
    const int count = static_cast<int>(std::min<int64_t>(8, pairs - p0));
    for (int j = 0; j < count; ++j) {
      const int64_t p = p0 + j;
      const bool single = last_single && p == pairs - 1;
      __m512i xq[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xq[r] = _mm512_loadu_si512(x.codes + r * x.K_pad + p * 64);
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) {
        const uint8_t* row = w.q + (n0 + i) * w.row_bytes;
        // The next block's rows, a cache line at a time (a pair of 4-bit runs is half of one).
        if (!kU4 || p % 2 == 0) prefetch(row + NR * w.row_bytes + p * (kU4 ? 32 : 64));
        const __m512i u = unsigned_codes<kU4>(row, p, single);
        const __m512 s = kG == 32 ? _mm512_permutexvar_ps(pair_groups<kU4>(j), loaded[i])
                                  : _mm512_set1_ps(to_f32(w.scales[(n0 + i) * w.groups + p * 64 / w.group_size]));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i start =
              x.offsets ? _mm512_loadu_si512(x.offsets + r * lanes + p * 16) : _mm512_setzero_si512();
          const __m512i dot = _mm512_dpbusd_epi32(start, u, xq[r]);
          const __m512 d = _mm512_loadu_ps(x.scales + r * lanes + p * 16);
          acc[i][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), s, acc[i][r]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 total = acc[i][r];
      if constexpr (kMin) {  // + sum_g min_g * (sum of x over group g)
        for (int64_t g = 0; g < w.groups; g += 16) {
          const __mmask16 m = tail_mask(w.groups - g);
          total = _mm512_fmadd_ps(load_groups(w.mins + (n0 + i) * w.groups + g, m),
                                  _mm512_maskz_loadu_ps(m, x.sums + r * x.groups + g), total);
        }
      }
      acc_out[i][r] = _mm512_reduce_add_ps(total);
    }
  }
}

template <typename T>
inline void store(T* p, float v) { *p = static_cast<T>(v); }

// Output columns [n_begin, n_end) for R rows of x: weight rows in blocks of NR (4 for one row of x,
// whose independent sums hide each other's latency; fewer as rows of x take registers).
template <int R, bool kU4, bool kMin, int kG, typename S, typename T>
void rows_block(const Packed<S>& w, int64_t n_begin, int64_t n_end, const RowsView& x, const float* bias, T* out,
                int64_t ldo) {
  constexpr int NR = R == 1 ? 4 : R == 2 ? 2 : 1;
  float acc[NR][R];
  int64_t n = n_begin;
  auto write = [&](int64_t n0, int rows, auto& a) {
    for (int i = 0; i < rows; ++i)
      for (int r = 0; r < R; ++r) store(out + r * ldo + n0 + i, a[i][r] + (bias ? bias[n0 + i] : 0.0f));
  };
  for (; n + NR <= n_end; n += NR) {
    int8_dot<NR, R, kU4, kMin, kG>(w, n, x, acc);
    write(n, NR, acc);
  }
  for (; n < n_end; ++n) {
    float one[1][R];
    int8_dot<1, R, kU4, kMin, kG>(w, n, x, one);
    write(n, 1, one);
  }
}

template <bool kU4, bool kMin, int kG, typename S, typename T>
void linear_rows(const Packed<S>& w, int64_t n_begin, int64_t n_end, const RowsView& x, int64_t M, const float* bias,
                 T* out, int64_t ldo) {
  for (int64_t m = 0; m < M;) {
    const RowsView xm = x.offset(m);
    T* om = out + m * ldo;
    if (M - m >= 4) {
      rows_block<4, kU4, kMin, kG>(w, n_begin, n_end, xm, bias, om, ldo), m += 4;
    } else if (M - m >= 2) {
      rows_block<2, kU4, kMin, kG>(w, n_begin, n_end, xm, bias, om, ldo), m += 2;
    } else {
      rows_block<1, kU4, kMin, kG>(w, n_begin, n_end, xm, bias, om, ldo), m += 1;
    }
  }
}

// Interleaved weights: 16 rows' scales (or mins) of one group as fp32.
inline __m512 load_rows16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_rows16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_rows16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_rows16(c10::BFloat16* p, __m512 v) { pagedllm_vec::store_f32(p, v); }

// out[r, 16 rows of group g16] for R rows of x from m0. Per block: the codes' chunks unpacked once,
// then per row of x two chains of vpdpbusd (started at c * the block's code sum: the codebook's
// offset, the same for every weight row), one conversion, one multiply-add by scale * d.
template <int R, bool kU4, bool kMin, typename S, typename T>
void interleaved_rows(const uint8_t* codes, const S* scales, const S* mins, int64_t K, int64_t group_size, int c,
                      const Int8Rows& x, int64_t m0, const float* bias, T* out, int64_t ldo, int64_t n0) {
  constexpr int kChunks = kU4 ? 4 : 8;
  constexpr int64_t kBlockBytes = kChunks * 64;
  const int64_t blocks = K / kBlock, per_group = group_size / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = codes + b * kBlockBytes;
    __m512i w[8];  // w[i] pairs with x's codes 4i..4i+3
#pragma GCC unroll 8
    for (int i = 0; i < kChunks; ++i) {
      const __m512i v = _mm512_loadu_si512(at + 64 * i);
      if constexpr (kU4) {
        w[i] = _mm512_and_si512(v, nibble);
        w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      } else {
        w[i] = _mm512_xor_si512(v, sign);  // u = w + 128, c = -128
      }
    }
    const int64_t g = b / per_group;
    const __m512 s = load_rows16(scales + g * kInterleavedRows);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xb = x.codes_of(m) + b * kBlock;
      __m512i even = _mm512_set1_epi32(c * x.code_sums_of(m)[b]), odd = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; i += 2) {
        int32_t q0, q1;
        std::memcpy(&q0, xb + 4 * i, 4);
        std::memcpy(&q1, xb + 4 * i + 4, 4);
        even = _mm512_dpbusd_epi32(even, w[i], _mm512_set1_epi32(q0));
        odd = _mm512_dpbusd_epi32(odd, w[i + 1], _mm512_set1_epi32(q1));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(x.block_scales_of(m)[b])), acc[r]);
    }
    if constexpr (kMin) {  // + min_g * (sum of x over group g), once the group's last block is in
      if ((b + 1) % per_group == 0) {
        const __m512 mn = load_rows16(mins + g * kInterleavedRows);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.sums_of(m0 + r)[g]), acc[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) store_rows16(out + (m0 + r) * ldo + n0, acc[r]);
}

// interleaved_rows over two groups of 16 weight rows at once (32 output columns, the second group's
// codes, scales and mins codes_stride and group_stride on): each broadcast of x's 4 codes feeds
// both groups' vpdpbusd. One group's kernel issues a broadcast load per product, and those loads,
// not the products, bound it on Zen 4 once x has a few rows. The same sums in the same order:
// bit for bit interleaved_rows' results.
template <int R, bool kU4, bool kMin, typename S, typename T>
void interleaved_rows_pair(const uint8_t* codes, int64_t codes_stride, const S* scales, const S* mins,
                           int64_t group_stride, int64_t K, int64_t group_size, int c, const Int8Rows& x, int64_t m0,
                           const float* bias, T* out, int64_t ldo, int64_t n0) {
  constexpr int kChunks = kU4 ? 4 : 8;
  constexpr int64_t kBlockBytes = kChunks * 64;
  const int64_t blocks = K / kBlock, per_group = group_size / kBlock;
  const __m512i nibble = _mm512_set1_epi8(0x0F), sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[2][R];
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[g][r] = bias ? _mm512_loadu_ps(bias + n0 + g * kInterleavedRows) : _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at[2] = {codes + b * kBlockBytes, codes + codes_stride + b * kBlockBytes};
    __m512i dot[2][R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) dot[0][r] = dot[1][r] = _mm512_set1_epi32(c * x.code_sums_of(m0 + r)[b]);
    // The codes of chunk i pair with x's codes 4i..4i+3 (u4: the low nibbles; the high ones with
    // 16+4i..16+4i+3).
    auto multiply = [&](const __m512i (&w)[2], int64_t first_code) {
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, x.codes_of(m0 + r) + b * kBlock + first_code, 4);
        const __m512i xq = _mm512_set1_epi32(q);
        dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], w[0], xq);
        dot[1][r] = _mm512_dpbusd_epi32(dot[1][r], w[1], xq);
      }
    };
#pragma GCC unroll 8
    for (int i = 0; i < kChunks; ++i) {
      const __m512i v[2] = {_mm512_loadu_si512(at[0] + 64 * i), _mm512_loadu_si512(at[1] + 64 * i)};
      if constexpr (kU4) {
        const __m512i low[2] = {_mm512_and_si512(v[0], nibble), _mm512_and_si512(v[1], nibble)};
        multiply(low, 4 * i);
        const __m512i high[2] = {_mm512_and_si512(_mm512_srli_epi16(v[0], 4), nibble),
                                 _mm512_and_si512(_mm512_srli_epi16(v[1], 4), nibble)};
        multiply(high, 4 * (i + 4));
      } else {
        const __m512i u[2] = {_mm512_xor_si512(v[0], sign), _mm512_xor_si512(v[1], sign)};  // u = w + 128, c = -128
        multiply(u, 4 * i);
      }
    }
    const int64_t g = b / per_group;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 s = load_rows16(scales + h * group_stride + g * kInterleavedRows);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r)
        acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[h][r]),
                                    _mm512_mul_ps(s, _mm512_set1_ps(x.block_scales_of(m0 + r)[b])), acc[h][r]);
      if constexpr (kMin) {
        if ((b + 1) % per_group == 0) {
          const __m512 mn = load_rows16(mins + h * group_stride + g * kInterleavedRows);
#pragma GCC unroll 6
          for (int r = 0; r < R; ++r) acc[h][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.sums_of(m0 + r)[g]), acc[h][r]);
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) store_rows16(out + (m0 + r) * ldo + n0 + h * kInterleavedRows, acc[h][r]);
}
#endif  // __AVX512VNNI__

}  // namespace

bool quant_linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                       int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out) {
#ifdef __AVX512VNNI__
  if (!int8_layout(bits, group_size, codebook)) return false;
  const Weights t{qweight, scales, mins, codebook, bits, group_size};
  const int offset = bits == 8 ? -128 : *affine_codebook_offset(codebook->const_data_ptr<float>());
  const Int8Rows rows = quantize_rows(x, group_size, offset,
                                     {.sums = mins.has_value(), .nibble_order = bits == 4, .lane_scales = true});
  const RowsView view{rows.codes.data(), rows.lane_scales.data(), rows.offsets_of(0), rows.sums_of(0), rows.K_pad,
                      rows.groups};
  const int64_t N = qweight.size(0), M = x.size(0), ldo = out.stride(0);
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 17) / std::max<int64_t>(rows.K * std::min<int64_t>(M, 4), 1));
  dispatch(t, [&](const auto& w, auto is_u4, auto with_min) {
    constexpr bool kU4 = decltype(is_u4)::value, kMin = decltype(with_min)::value;
    auto run = [&](auto* op) {
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        if (group_size == 32) linear_rows<kU4, kMin, 32>(w, n0, n1, view, M, bp, op, ldo);
        else linear_rows<kU4, kMin, 64>(w, n0, n1, view, M, bp, op, ldo);  // a multiple of 64
      });
    };
    if (out.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
    else run(out.mutable_data_ptr<c10::BFloat16>());
  });
  return true;
#else
  return false;
#endif
}

bool quant_linear_int8_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook,
                                   int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias,
                                   at::Tensor& out) {
#ifdef __AVX512VNNI__
  const InterleavedWeights w = check_interleaved(x, qweight, scales, mins, codebook, bits, group_size, bias, out);
  const int c = bits == 8 ? -128 : *affine_codebook_offset(codebook->const_data_ptr<float>());
  const Int8Rows rows = quantize_rows(x, group_size, /*offset=*/0, {.sums = mins.has_value(), .code_sums = true});
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t K = x.size(1), ldo = out.stride(0);
  const int64_t group_stride = w.groups * kInterleavedRows, codes_stride = w.blocks * w.block_bytes;
  auto group = [&](auto is_u4, auto with_min, const uint8_t* codes, const auto* s, const auto* mn, auto* op,
                   int64_t n0, int64_t count, int64_t m_begin, int64_t m_end) {
    constexpr bool kU4 = decltype(is_u4)::value, kMin = decltype(with_min)::value;
    if (count == 2) {
      for (int64_t m = m_begin; m < m_end;) {
        // 5 or 6 rows in one pass (a speculative step verifying 4 or 5 proposals): fewer unpacked
        // codes and loads than 4 + 1 or 4 + 2; more would spill the accumulators.
        if (m_end - m == 5) interleaved_rows_pair<5, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 5;
        else if (m_end - m == 6) interleaved_rows_pair<6, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 6;
        else if (m_end - m >= 4) interleaved_rows_pair<4, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 4;
        else if (m_end - m == 3) interleaved_rows_pair<3, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 3;
        else if (m_end - m == 2) interleaved_rows_pair<2, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 2;
        else interleaved_rows_pair<1, kU4, kMin>(codes, codes_stride, s, mn, group_stride, K, group_size, c, rows, m, bp, op, ldo, n0), m += 1;
      }
      return;
    }
    for (int64_t m = m_begin; m < m_end;) {
      if (m_end - m >= 4) interleaved_rows<4, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, bp, op, ldo, n0), m += 4;
      else if (m_end - m == 3) interleaved_rows<3, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, bp, op, ldo, n0), m += 3;
      else if (m_end - m == 2) interleaved_rows<2, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, bp, op, ldo, n0), m += 2;
      else interleaved_rows<1, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, bp, op, ldo, n0), m += 1;
    }
  };
  for_each_interleaved_group(w, bits, scales, mins, rows, out, group, /*step=*/2);
  return true;
#else
  return false;
#endif
}

}  // namespace pagedllm_int8
