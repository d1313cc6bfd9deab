// The few-rows quantized matmul with int8 activations (quant_int8_rows.h) on AVX2: for bf16
// activations, whose decode steps then run on integer dot products, as llama.cpp's do.
//
// Per block of 32 inputs and weight row, the codes as unsigned bytes in the inputs' order:
//  u4: a run's 16 bytes, low nibbles then high ones (codes 0..15, the codebook's u + c);
//  i8: |w|, with w's sign moved onto x's codes (vpsignb), c = 0.
// The products of unsigned and signed bytes are summed in fours into 8 int32 lanes: with AVX-VNNI
// by vpdpbusd, else by vpmaddubsw (pairs into int16: at most 2 * 128 * 127, under its saturation)
// and vpmaddwd (pairs of those into int32). Started at c * (x's codes' sums), exact; then per row
// of x converted to fp32, times the block's d and the weight group's scale, summed in fp32 from
// the mins' term.
//
// Row-interleaved weights (quant_int8_rows.h) run as 8 rows to a vector, each 64-byte chunk's two
// halves in turn (the 16 rows' codes stay in L1 between them): one int32 lane per weight row, x's
// 4 codes broadcast, and per block one conversion, one scale vector and one multiply-add for 8
// rows, where the per-row kernel spends a conversion and a multiply-add per row and a horizontal
// sum at its end.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#ifdef __AVX2__
#include <immintrin.h>

#include "vec_avx2.h"
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdint>
#include <optional>
#include <vector>

#include "generic_quant_layout.h"
#include "quant_int8_rows.h"

namespace pagedllm_int8 {
namespace {

#ifdef __AVX2__
using pagedllm_generic::Layout;
using pagedllm_vec_avx2::hsum;

// acc + the products of u (unsigned bytes) and s (signed), summed in fours.
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A group's value (scale or min) with F16C's one-instruction conversion.
inline float group_value(const Layout& l, const void* p, int64_t n, int64_t g) {
  const int64_t i = n * (l.K / l.G) + g;
  return l.half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// 8 consecutive group values (scales or mins) of weight row n from group g on, in fp32.
inline __m256 group_values8(const Layout& l, const void* p, int64_t n, int64_t g) {
  const int64_t i = n * (l.K / l.G) + g;
  return l.half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
                : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

// out[b]: the scale of weight row n's block b in fp32 for b < K / 32, then 0 up to a multiple of
// 8, converted once per row (per block, the group's index and conversion, a division among them,
// cost more than the block's integer products). Whole vectors where a group is one block (the
// GGUF layouts).
inline void row_scales(const Layout& l, int64_t n, float* out) {
  const int64_t groups = l.K / l.G, per_group = l.G / kBlock, blocks = l.K / kBlock;
  int64_t g = 0;
  if (per_group == 1)
    for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(out + g, group_values8(l, l.scales, n, g));
  for (; g < groups; ++g) {
    const float s = group_value(l, l.scales, n, g);
    for (int64_t i = 0; i < per_group; ++i) out[g * per_group + i] = s;
  }
  std::fill(out + blocks, out + (blocks + 7) / 8 * 8, 0.0f);
}

// sum_g min_g * sums[g] for weight row n and a row of x's group sums, as 8 lanes to start the
// row's accumulator from: its horizontal sum then adds them (one fold per row, not two).
inline __m256 min_lanes(const Layout& l, int64_t n, const float* sums) {
  const int64_t groups = l.K / l.G;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(group_values8(l, l.mins, n, g), _mm256_loadu_ps(sums + g), acc);
  float tail = 0.0f;
  for (; g < groups; ++g) tail += group_value(l, l.mins, n, g) * sums[g];
  return _mm256_add_ps(acc, _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, tail));
}

// out[r] = x[r] . w[n] for R rows of x (Int8Rows, rows m0..m0+R-1); scales: room for (R + 1) *
// x.blocks_pad() floats. Per block: the weight codes as unsigned bytes once, then per row of x its
// integer products (started at the lane offsets where c != 0), converted, times the row's
// combined scale for the block (the weight's times x's, made for the whole row in vectors first):
// one formula whatever R, so a row's result does not depend on the rows beside it (batch-invariant
// mode relies on it). Even and odd blocks sum into two accumulators: one chain of fmadds would
// wait on its latency every block. The rows' pointers are read once, not per block (kOffsets: x
// has lane offsets, c != 0).
template <int R, bool kU4, bool kOffsets>
inline void row_dots(const Layout& l, int64_t n, const Int8Rows& x, int64_t m0, float* scales, float* out) {
  const int64_t blocks = l.K / kBlock, stride = x.blocks_pad();
  const uint8_t* row = l.codes + n * l.row_bytes;
  float* weight_scales = scales + R * stride;
  row_scales(l, n, weight_scales);
  const int8_t* codes[R];
  const int32_t* offsets[R];
  const float* combined[R];
  __m256 even[R], odd[R];
  for (int r = 0; r < R; ++r) {
    codes[r] = x.codes_of(m0 + r);
    offsets[r] = x.offsets_of(m0 + r);
    const float* dx = x.block_scales_of(m0 + r);
    float* c = scales + r * stride;
    for (int64_t b = 0; b < stride; b += 8)
      _mm256_storeu_ps(c + b, _mm256_mul_ps(_mm256_loadu_ps(weight_scales + b), _mm256_loadu_ps(dx + b)));
    combined[r] = c;
    even[r] = l.mins ? min_lanes(l, n, x.sums_of(m0 + r)) : _mm256_setzero_ps();
    odd[r] = _mm256_setzero_ps();
  }
  auto block = [&](int64_t b, __m256 (&acc)[R]) __attribute__((always_inline)) {
    __m256i u, w;
    if constexpr (kU4) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
      u = _mm256_abs_epi8(w);
    }
    for (int r = 0; r < R; ++r) {
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r] + b * kBlock));
      if constexpr (!kU4) xq = _mm256_sign_epi8(xq, w);
      __m256i start = _mm256_setzero_si256();
      if constexpr (kOffsets) start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets[r] + b * 8));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_add(start, u, xq)), _mm256_broadcast_ss(combined[r] + b), acc[r]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    block(b, even);
    block(b + 1, odd);
  }
  if (b < blocks) block(b, even);
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(even[r], odd[r]));
}

template <int R, bool kU4>
inline void row_dots(const Layout& l, int64_t n, const Int8Rows& x, int64_t m0, float* scales, float* out) {
  if (x.offsets_of(m0) != nullptr) row_dots<R, kU4, true>(l, n, x, m0, scales, out);
  else row_dots<R, kU4, false>(l, n, x, m0, scales, out);
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

template <bool kU4, typename T>
void linear_rows(const Layout& l, int64_t n0, int64_t n1, const Int8Rows& x, const float* bias, T* out, int64_t ldo) {
  float sums[4];
  std::vector<float> scales(5 * x.blocks_pad());  // row_dots' combined scales: 4 rows and the weight's
  for (int64_t m0 = 0; m0 < x.M;) {
    const int rows = x.M - m0 >= 4 ? 4 : x.M - m0 >= 2 ? 2 : 1;
    for (int64_t n = n0; n < n1; ++n) {
      if (rows == 4) row_dots<4, kU4>(l, n, x, m0, scales.data(), sums);
      else if (rows == 2) row_dots<2, kU4>(l, n, x, m0, scales.data(), sums);
      else row_dots<1, kU4>(l, n, x, m0, scales.data(), sums);
      for (int r = 0; r < rows; ++r) store(out + (m0 + r) * ldo + n, sums[r] + (bias ? bias[n] : 0.0f));
    }
    m0 += rows;
  }
}

// 8 rows' scales (or mins) of one group, interleaved, in fp32.
inline __m256 rows8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 rows8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[m0 .. m0+R-1, n0 .. n0+7]: half `half` (rows 8 * half ..) of one interleaved group of 16 rows.
// Per block, per row of x: the chunks' dot products into one int32 accumulator (started at c *
// the block's code sum; without AVX-VNNI the chain is a plain add), converted, times scale * d.
template <int R, bool kU4, bool kMin, typename S, typename T>
void interleaved_half(const uint8_t* codes, const S* scales, const S* mins, int64_t K, int64_t group_size, int c,
                      const Int8Rows& x, int64_t m0, int half, const float* bias, T* out, int64_t ldo, int64_t n0) {
  constexpr int kChunks = kU4 ? 4 : 8;
  constexpr int64_t kBlockBytes = kChunks * 64;
  const int64_t blocks = K / kBlock, per_group = group_size / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = codes + b * kBlockBytes + 32 * half;
    __m256i dots[R];
    for (int r = 0; r < R; ++r) dots[r] = kU4 ? _mm256_set1_epi32(c * x.code_sums_of(m0 + r)[b]) : _mm256_setzero_si256();
    for (int i = 0; i < kChunks; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64 * i));
      if constexpr (kU4) {
        const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = x.codes_of(m0 + r) + b * kBlock;
          int32_t q0, q1;
          std::memcpy(&q0, xb + 4 * i, 4);
          std::memcpy(&q1, xb + 16 + 4 * i, 4);
          dots[r] = dot_add(dot_add(dots[r], low, _mm256_set1_epi32(q0)), high, _mm256_set1_epi32(q1));
        }
      } else {  // |w| against x's codes with w's signs (c = 0: the sign moved, no offset)
        const __m256i magnitude = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          int32_t q;
          std::memcpy(&q, x.codes_of(m0 + r) + b * kBlock + 4 * i, 4);
          dots[r] = dot_add(dots[r], magnitude, _mm256_sign_epi8(_mm256_set1_epi32(q), v));
        }
      }
    }
    const int64_t g = b / per_group;
    const __m256 s = rows8(scales + g * kInterleavedRows + 8 * half);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]),
                               _mm256_mul_ps(s, _mm256_set1_ps(x.block_scales_of(m0 + r)[b])), acc[r]);
    if constexpr (kMin) {
      if ((b + 1) % per_group == 0) {
        const __m256 mn = rows8(mins + g * kInterleavedRows + 8 * half);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.sums_of(m0 + r)[g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) pagedllm_vec_avx2::store8(out + (m0 + r) * ldo + n0, acc[r]);
}
#endif  // __AVX2__

}  // namespace

bool quant_linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                       int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out) {
#ifdef __AVX2__
  if (!int8_layout(bits, group_size, codebook)) return false;
  const Layout l = pagedllm_generic::make_layout(qweight, scales, mins, codebook, bits, group_size);
  const int offset = bits == 8 ? 0 : *affine_codebook_offset(l.book);
  const Int8Rows rows = quantize_rows(x, group_size, offset, {.sums = mins.has_value()});
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t ldo = out.stride(0);
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(l.K, 1));
  auto run = [&](auto* op) {
    // Chunks of weight rows taken in turn, not a fixed share per thread: a VM's cores run at
    // different speeds from one call to the next, and a static split waits on the slower.
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), (l.N + grain - 1) / grain);
    const int64_t chunk = std::max<int64_t>(grain, (l.N + 8 * threads - 1) / (8 * threads));
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t n0 = next.fetch_add(chunk); n0 < l.N; n0 = next.fetch_add(chunk)) {
        if (bits == 4) linear_rows<true>(l, n0, std::min(l.N, n0 + chunk), rows, bp, op, ldo);
        else linear_rows<false>(l, n0, std::min(l.N, n0 + chunk), rows, bp, op, ldo);
      }
    });
  };
  if (out.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
  else run(out.mutable_data_ptr<c10::BFloat16>());
  return true;
#else
  return false;
#endif
}

bool quant_linear_int8_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook,
                                   int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias,
                                   at::Tensor& out) {
#ifdef __AVX2__
  const InterleavedWeights w = check_interleaved(x, qweight, scales, mins, codebook, bits, group_size, bias, out);
  // c: the codebook's offset for 4-bit codes; int8 codes move their sign onto x instead (c = 0).
  const int c = bits == 8 ? 0 : *affine_codebook_offset(codebook->const_data_ptr<float>());
  const Int8Rows rows = quantize_rows(x, group_size, /*offset=*/0, {.sums = mins.has_value(), .code_sums = bits == 4});
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t K = x.size(1), ldo = out.stride(0);
  auto group = [&](auto is_u4, auto with_min, const uint8_t* codes, const auto* s, const auto* mn, auto* op,
                   int64_t n0, int64_t /*count: 1, the default step*/, int64_t m_begin, int64_t m_end) {
    constexpr bool kU4 = decltype(is_u4)::value, kMin = decltype(with_min)::value;
    for (int half = 0; half < 2; ++half) {
      const int64_t n = n0 + 8 * half;  // the half's first output column
      for (int64_t m = m_begin; m < m_end;) {
        if (m_end - m >= 4) interleaved_half<4, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, half, bp, op, ldo, n), m += 4;
        else if (m_end - m >= 2) interleaved_half<2, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, half, bp, op, ldo, n), m += 2;
        else interleaved_half<1, kU4, kMin>(codes, s, mn, K, group_size, c, rows, m, half, bp, op, ldo, n), m += 1;
      }
    }
  };
  for_each_interleaved_group(w, bits, scales, mins, rows, out, group);
  return true;
#else
  return false;
#endif
}

}  // namespace pagedllm_int8
