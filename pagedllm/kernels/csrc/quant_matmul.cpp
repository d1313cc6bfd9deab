// Matmuls over weights kept quantized (pagedllm/model/quant_weight.py lays them out), for CPUs with
// AVX-512. Weight-only: activations stay in the model's dtype and the sums run in fp32.
//
// Two packed formats, both row-major over the output features, [N, K] logically:
//  u4: 4-bit codes, two per byte. For each run of 32 inputs k0..k0+31, 16 bytes: byte j holds code
//      k0+j in its low nibble and code k0+16+j in its high nibble (GGUF's Q4_0 / Q4_1 order). A code
//      indexes a 16-entry codebook (0..15, or -8..7, or IQ4_NL's values): w = scale * book[q] + min.
//      Group size 16 or a multiple of 32.
//  i8: signed 8-bit codes: w = scale * q + min. Group size a multiple of 16.
// scales / mins: float16 or float32 [N, K / group]; mins absent means 0.
//
// quant_linear computes out = x @ W^T (+ bias) for a few rows of x (decode steps): each weight is
// read and decoded once per block of up to 8 rows of x. With VNNI, bf16 x goes through int8
// activations and integer dot products instead (quant_int8_avx512.cpp) where the layout allows
// (quant_int8_rows.h); float32 x always takes the exact path below. Larger batches go through
// quant_dequantize tile by tile and a GEMM (the caller, pagedllm/model/quant_linear.py, picks).
//
// float32 x: each weight is dequantized in registers to exactly the float32 value the GGUF
// reference dequantizer gives (scale * value + min, one rounding), then multiplied: the result is
// the dequantized matmul's up to the order of the sums. For u4, 16 codes widened to 32-bit lanes
// index the group's 16-value table (scale * book + min, built once per group) with one permute
// (vpermps reads only the low 4 bits of each lane, so the high nibble needs one shift).
//
// bfloat16 x (4-bit codes): codes become the bf16 codebook values with one 16-bit permute per 32
// codes (every codebook value is exact in bf16), and vdpbf16ps multiplies them with x in pairs,
// exactly, summing in fp32: sum_k x_k (s q_k + m) = s * sum_k x_k q_k + m * sum_k x_k, the scale
// applied once per group and the min through per-group sums of x. Twice fewer instructions than
// dequantizing to fp32. x is first laid out in the codes' order: per 64 inputs, the low-nibble
// halves of both runs of 32, then the high ones.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "quant_int8_rows.h"
#include "ops.h"
#include "quant_packed.h"
#include "vec.h"

namespace {
using namespace pagedllm_quant;

constexpr int kMaxRows = 8;  // rows of x sharing one decoded weight vector

// The kernels read a block of weight rows at a time, each row a short run (a few hundred bytes):
// too short for the hardware prefetcher to get ahead, so each block asks for the next block's
// codes (1.25x faster decode steps, measured; further ahead was no better).
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// ---- float32 activations: weights dequantized exactly in registers --------------------------

// acc[nr][r] = sum_k x[r][k] * w[n0 + nr][k], for NR weight rows and R rows of x.
template <int NR, int R, bool kMin, typename S>
inline void u4_dot(const Packed<S>& w, int64_t n0, const float* x, int64_t ldx, float (&acc_out)[NR][R]) {
  const __m512 book = _mm512_loadu_ps(w.book);
  __m512 acc[NR][R];
  __m512 lo_tab[NR], hi_tab[NR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for_each_u4_chunk(w, [&](int64_t c, int64_t g_lo, int64_t g_hi, bool new_group) __attribute__((always_inline)) {
    if (new_group) {
      for (int i = 0; i < NR; ++i) {
        lo_tab[i] = u4_table<kMin>(w, book, n0 + i, g_lo);
        hi_tab[i] = g_hi == g_lo ? lo_tab[i] : u4_table<kMin>(w, book, n0 + i, g_hi);
      }
    }
    for (int i = 0; i < NR; ++i) {
      if (c % 4 == 0) prefetch(w.q + (n0 + NR + i) * w.row_bytes + c * 16);  // the next block's rows
      const __m512i codes = u4_codes(w, n0 + i, c);
      const __m512 lo = _mm512_permutexvar_ps(codes, lo_tab[i]);
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), hi_tab[i]);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + c * 32;
        acc[i][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[i][r]);
      }
    }
  });
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc_out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

template <int NR, int R, bool kMin, typename S>
inline void i8_dot(const Packed<S>& w, int64_t n0, const float* x, int64_t ldx, float (&acc_out)[NR][R]) {
  __m512 acc[NR][R];
  __m512 scale[NR], min[NR];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int i = 0; i < NR; ++i) {
      scale[i] = _mm512_set1_ps(w.scale(n0 + i, g));
      min[i] = kMin ? _mm512_set1_ps(w.min(n0 + i, g)) : scale[i];
    }
    for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k += 16) {
      for (int i = 0; i < NR; ++i) {
        if (k % 64 == 0) prefetch(w.q + (n0 + NR + i) * w.row_bytes + k);  // the next block's rows
        const __m512 wv = fma_or_mul(i8_codes(w, n0 + i, k), scale[i], min[i], kMin);
        for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * ldx + k), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc_out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}

// ---- bfloat16 activations, 4-bit codes: bf16 dot products ------------------------------------

// x [M, K] bf16 laid out in the codes' order, zero-padded to a multiple of 64, and (for mins)
// the sums of x over each group.
struct Bf16Rows {
  at::Tensor laid_out;  // [M, K64] bf16
  at::Tensor group_sums;  // [M, groups] fp32, or undefined
};

Bf16Rows lay_out_bf16(const at::Tensor& x, int64_t group_size, bool sums) {
  const int64_t M = x.size(0), K = x.size(1), K64 = (K + 63) / 64 * 64;
  Bf16Rows rows{at::zeros({M, K64}, x.options()), at::Tensor()};
  if (sums) rows.group_sums = at::empty({M, K / group_size}, x.options().dtype(at::kFloat));
  const BF16* src = x.const_data_ptr<BF16>();
  BF16* dst = rows.laid_out.mutable_data_ptr<BF16>();
  for (int64_t m = 0; m < M; ++m) {
    const BF16* xr = src + m * x.stride(0);
    BF16* out = dst + m * K64;
    for (int64_t k = 0; k < K; k += 32) {  // run k..k+31: low half to lanes 0-15 or 16-31 of the lo vector
      const int64_t block = k / 64 * 64, second = (k / 32) % 2;
      std::copy(xr + k, xr + k + 16, out + block + 16 * second);
      std::copy(xr + k + 16, xr + k + 32, out + block + 32 + 16 * second);
    }
    if (sums) {
      float* s = rows.group_sums.mutable_data_ptr<float>() + m * (K / group_size);
      for (int64_t g = 0; g < K / group_size; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
          acc = _mm512_add_ps(acc, load_f32(xr + k, tail_mask(std::min<int64_t>(16, (g + 1) * group_size - k))));
        s[g] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  return rows;
}

// Whether u4_dot_bf16 takes this group size (others: the fp32 kernel).
inline bool bf16_dots_take(int64_t group_size) { return group_size == 16 || group_size == 32 || group_size % 64 == 0; }

#ifdef __AVX512BF16__
// Per-group values (scales or mins) of groups g .. g+count-1 (count <= 16) in lanes 0.. as fp32.
inline __m512 group_values(const float* p, int count) { return _mm512_maskz_loadu_ps(tail_mask(count), p); }
inline __m512 group_values(const c10::Half* p, int count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(count), p));
}

// The scales of one pair of runs of 32 codes (64 inputs), per fp32 lane of the dot products: lanes
// 0-7 hold the first run's low-nibble half and lanes 8-15 the second run's, in `lo`; the high
// halves likewise in `hi`. kG: the group size, 16, 32 or a multiple of 64 (one group per pair).
template <int kG, typename S>
inline void pair_scales(const S* __restrict row_scales, int64_t p, int64_t group_of_pair, bool single_run,
                        __m512& lo, __m512& hi) {
  if constexpr (kG == 16) {  // groups 4p..4p+3: lo [4p, 4p+2], hi [4p+1, 4p+3]
    const __m512 v = group_values(row_scales + 4 * p, single_run ? 2 : 4);
    lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), v);
    hi = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), v);
  } else if constexpr (kG == 32) {  // groups 2p, 2p+1
    const __m512 v = group_values(row_scales + 2 * p, single_run ? 1 : 2);
    lo = hi = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), v);
  } else {
    lo = hi = _mm512_set1_ps(to_f32(row_scales[group_of_pair]));
  }
}

// acc[nr][r] = sum_k x[r][k] * w[n0 + nr][k] (x laid out by lay_out_bf16, K64 per row).
template <int NR, int R, bool kMin, int kG, typename S>
inline void u4_dot_bf16(const Packed<S>& w, int64_t n0, const BF16* __restrict x, int64_t K64,
                        const float* __restrict sums, float (&acc_out)[NR][R]) {
  // The codebook as bf16, twice: vpermw takes 5 index bits and a byte's high nibble sets bit 4.
  const __m256i book_half = to_bf16_bits(_mm512_loadu_ps(w.book));
  const __m512i book = _mm512_inserti64x4(_mm512_castsi256_si512(book_half), book_half, 1);
  const uint8_t* __restrict q = w.q + n0 * w.row_bytes;
  const int64_t row_bytes = w.row_bytes, groups = w.groups;
  const S* __restrict scales = w.scales + n0 * groups;
  const int64_t pairs = K64 / 64, pairs_per_group = std::max<int64_t>(1, w.group_size / 64);
  const bool last_single = w.K % 64 != 0;  // the last pair has one run of 32 (x is zero after it)
  __m512 acc[NR][R];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bool single = last_single && p == pairs - 1;
    const int64_t group_of_pair = kG >= 64 ? p / pairs_per_group : 0;
    __m512bh xlo[R], xhi[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xlo[r] = (__m512bh)_mm512_loadu_si512(x + r * K64 + p * 64);
      xhi[r] = (__m512bh)_mm512_loadu_si512(x + r * K64 + p * 64 + 32);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const uint8_t* codes_at = q + i * row_bytes + p * 32;
      if (p % 2 == 0) prefetch(codes_at + NR * row_bytes);  // the next block's rows
      const __m256i bytes = single ? _mm256_maskz_loadu_epi8(0xFFFF, codes_at)
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes_at));
      const __m512i codes = _mm512_cvtepu8_epi16(bytes);
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(codes, book);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), book);
      __m512 s_lo, s_hi;
      pair_scales<kG>(scales + i * groups, p, group_of_pair, single, s_lo, s_hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (kG == 16) {
          acc[i][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xlo[r], lo), s_lo, acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xhi[r], hi), s_hi, acc[i][r]);
        } else {
          const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xlo[r], lo), xhi[r], hi);
          acc[i][r] = _mm512_fmadd_ps(d, s_lo, acc[i][r]);
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
        for (int64_t g = 0; g < groups; g += 16) {
          const int count = static_cast<int>(std::min<int64_t>(16, groups - g));
          total = _mm512_fmadd_ps(group_values(w.mins + (n0 + i) * groups + g, count),
                                  _mm512_maskz_loadu_ps(tail_mask(count), sums + r * groups + g), total);
        }
      }
      acc_out[i][r] = _mm512_reduce_add_ps(total);
    }
  }
}

template <int NR, int R, bool kMin, typename S>
inline void u4_dot_bf16(const Packed<S>& w, int64_t n0, const BF16* x, int64_t K64, const float* sums,
                        float (&acc_out)[NR][R]) {
  switch (w.group_size) {
    case 16: return u4_dot_bf16<NR, R, kMin, 16>(w, n0, x, K64, sums, acc_out);
    case 32: return u4_dot_bf16<NR, R, kMin, 32>(w, n0, x, K64, sums, acc_out);
    default: return u4_dot_bf16<NR, R, kMin, 64>(w, n0, x, K64, sums, acc_out);  // G % 64 == 0
  }
}

#endif  // __AVX512BF16__

// ---- blocks of rows, threads ----------------------------------------------------------------

template <typename T>
inline void store(T* p, float v) { *p = static_cast<T>(v); }

// x as one of the kernels takes it: fp32 rows, or bf16 rows laid out for u4_dot_bf16.
struct Activations {
  const float* f32 = nullptr;
  int64_t ldx = 0;
  const BF16* bf16 = nullptr;
  int64_t K64 = 0;
  const float* sums = nullptr;

  Activations offset(int64_t rows, int64_t groups) const {
    Activations a = *this;
    if (f32) a.f32 += rows * ldx;
    if (bf16) a.bf16 += rows * K64;
    if (sums) a.sums += rows * groups;
    return a;
  }
};

// Rows n0..n0+NR of out for R rows of x, bias added before the one rounding to T.
template <int NR, int R, bool kU4, bool kMin, typename S, typename T>
inline void out_block(const Packed<S>& w, int64_t n0, const Activations& x, const float* bias, T* out, int64_t ldo) {
  float acc[NR][R];
  if constexpr (kU4) {
#ifdef __AVX512BF16__
    if (x.bf16) {
      u4_dot_bf16<NR, R, kMin>(w, n0, x.bf16, x.K64, x.sums, acc);
    } else {
      u4_dot<NR, R, kMin>(w, n0, x.f32, x.ldx, acc);
    }
#else
    u4_dot<NR, R, kMin>(w, n0, x.f32, x.ldx, acc);
#endif
  } else {
    i8_dot<NR, R, kMin>(w, n0, x.f32, x.ldx, acc);
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) store(out + r * ldo + n0 + i, acc[i][r] + (bias ? bias[n0 + i] : 0.0f));
}

// Output rows [n_begin, n_end) for R rows of x: weight rows in blocks of NR (4 for a single row of
// x, where independent accumulators hide the latency of the sums; fewer as R rows of x take
// registers).
template <int R, bool kU4, bool kMin, typename S, typename T>
void rows_block(const Packed<S>& w, int64_t n_begin, int64_t n_end, const Activations& x, const float* bias, T* out,
                int64_t ldo) {
  constexpr int NR = R == 1 ? 4 : R <= 4 ? 2 : 1;
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR) out_block<NR, R, kU4, kMin>(w, n, x, bias, out, ldo);
  for (; n < n_end; ++n) out_block<1, R, kU4, kMin>(w, n, x, bias, out, ldo);
}

// All M rows of x, in blocks of up to kMaxRows, over the output rows [n_begin, n_end): a block of
// weights is decoded once per kMaxRows rows of x while it is still in L1.
template <bool kU4, bool kMin, typename S, typename T>
void linear_rows(const Packed<S>& w, int64_t n_begin, int64_t n_end, const Activations& x, int64_t M, const float* bias,
                 T* out, int64_t ldo) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m;
    const Activations xm = x.offset(m, w.groups);
    T* om = out + m * ldo;
    if (left >= 8) {
      rows_block<8, kU4, kMin>(w, n_begin, n_end, xm, bias, om, ldo), m += 8;
    } else if (left >= 4) {
      rows_block<4, kU4, kMin>(w, n_begin, n_end, xm, bias, om, ldo), m += 4;
    } else if (left >= 2) {
      rows_block<2, kU4, kMin>(w, n_begin, n_end, xm, bias, om, ldo), m += 2;
    } else {
      rows_block<1, kU4, kMin>(w, n_begin, n_end, xm, bias, om, ldo), m += 1;
    }
  }
}

// ---- entry points ---------------------------------------------------------------------------

// Weight rows per task: enough work that a task outweighs a parallel region's start (a few us).
int64_t row_grain(int64_t K, int64_t M) {
  return std::max<int64_t>(16, (int64_t{1} << 17) / std::max<int64_t>(K * std::min<int64_t>(M, kMaxRows), 1));
}

// Whether quant_linear takes bf16 activations of this weight layout as int8 (quant_int8_rows.h).
bool quant_int8_takes(const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size) {
#ifdef __AVX512VNNI__
  return pagedllm_int8::int8_layout(bits, group_size, codebook);
#else
  return false;
#endif
}

}  // namespace

namespace pagedllm_ops {

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size, at::ScalarType dtype) {
  const Weights t{qweight, scales, mins, codebook, bits, group_size};
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: float32 or bfloat16 out");
  const int64_t N = qweight.size(0);
  const int64_t K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  at::Tensor out = at::empty({N, K}, qweight.options().dtype(dtype));
  dispatch(t, [&](const auto& w, auto is_u4, auto with_min) {
    auto run = [&](auto* op) {
      at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n)
          dequantize_row<decltype(is_u4)::value, decltype(with_min)::value>(w, n, op + n * K);
      });
    };
    if (dtype == at::kFloat) run(out.mutable_data_ptr<float>());
    else run(out.mutable_data_ptr<BF16>());
  });
  return out;
}


void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                  const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias,
                  at::Tensor& out) {
  if (qweight.dim() == 3) {  // row-interleaved (quant_int8_rows.h): the int8 kernel alone reads it
    TORCH_CHECK(pagedllm_int8::quant_linear_int8_interleaved(x, qweight, scales, mins, codebook, bits, group_size, bias, out),
                "quant_linear: row-interleaved weights need AVX2 or AVX-512 VNNI (QuantizedWeight.plain() undoes them)");
    return;
  }
  const Weights t{qweight, scales, mins, codebook, bits, group_size};
  const int64_t N = qweight.size(0), M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == (bits == 4 ? 2 : 1) * qweight.size(1),
              "quant_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "quant_linear: out must be [M, N] of x's dtype with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_linear: float32 or bfloat16 x");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "quant_linear: bias must be contiguous float32 [N]");
#ifdef __AVX512VNNI__
  if (x.scalar_type() == at::kBFloat16 &&
      pagedllm_int8::quant_linear_int8(x, qweight, scales, mins, codebook, bits, group_size, bias, out))
    return;
#endif
  Activations act;
  at::Tensor x32;
  Bf16Rows bf16_rows;
#ifdef __AVX512BF16__
  constexpr bool kBf16Dots = true;
#else
  constexpr bool kBf16Dots = false;
#endif
  if (kBf16Dots && x.scalar_type() == at::kBFloat16 && bits == 4 && bf16_dots_take(group_size)) {
    bf16_rows = lay_out_bf16(x, group_size, mins.has_value());
    act.bf16 = bf16_rows.laid_out.const_data_ptr<BF16>();
    act.K64 = bf16_rows.laid_out.size(1);
    act.sums = mins ? bf16_rows.group_sums.const_data_ptr<float>() : nullptr;
  } else {
    x32 = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    act.f32 = x32.const_data_ptr<float>();
    act.ldx = x32.stride(0);
  }
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t ldo = out.stride(0);
  dispatch(t, [&](const auto& w, auto is_u4, auto with_min) {
    auto run = [&](auto* op) {
      at::parallel_for(0, N, row_grain(w.K, M), [&](int64_t n0, int64_t n1) {
        linear_rows<decltype(is_u4)::value, decltype(with_min)::value>(w, n0, n1, act, M, bp, op, ldo);
      });
    };
    if (out.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
    else run(out.mutable_data_ptr<BF16>());
  });
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_int8_takes", &quant_int8_takes);  // no tensor to dispatch on: every backend
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("quant_linear", &pagedllm_ops::quant_linear);
  m.impl("quant_dequantize", &pagedllm_ops::quant_dequantize);
}
