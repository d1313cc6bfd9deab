// Activation rows quantized to int8 for integer dot products against quantized weights, shared by
// the two kernels that take them: quant_int8_avx512.cpp (AVX-512 VNNI) and quant_int8_avx2.cpp
// (AVX2's maddubs, or AVX-VNNI).
//
// As llama.cpp's q8_0 does: blocks of 32 inputs, each with a scale d = max|x| / 127 and codes
// q = round(x * (127 / max|x|)) (half to even, fp32 product) in -127..127, so x = d * q within d / 2.
// A weight of the quantized layouts (quant_packed.h) is s * (u + c) + m for an unsigned code u (a
// 4-bit code whose codebook is u + c, or an int8 code w stored as u = w + 128, c = -128) and a
// group's scale s and min m; then
//   sum_k x_k w_k ~ sum_blocks s * d * sum_k q_k (u_k + c) + sum_groups m * (sum of x over the group)
// The integer sums are exact (int32), started at c times the codes' sums, so only the rounding of x
// to d * q (and fp32 sums) separates the result from the dequantized matmul. The min term takes the
// float sums of x, not of d * q (x's own sums: no rounding of x there).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>

#include "vec_avx2.h"
#endif

namespace pagedllm_int8 {

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kLane = 4;    // inputs one 32-bit lane of an integer dot product sums
constexpr int64_t kPad = 64;    // rows are padded with zero codes to a multiple of this

// The integer c with codebook[i] == i + c for every 4-bit code i (exact), where there is one.
inline std::optional<int> affine_codebook_offset(const float* book) {
  const float c = book[0];
  if (c != std::nearbyint(c) || c < -128 || c > 127) return std::nullopt;
  for (int i = 0; i < 16; ++i)
    if (book[i] != c + static_cast<float>(i)) return std::nullopt;
  return static_cast<int>(c);
}

// Whether a weight layout can take int8 activations: groups of whole activation blocks, and 4-bit
// codes whose codebook is affine (Q4_0, Q4_1, Q4_K; not IQ4_NL's table, nor groups of 16).
inline bool int8_layout(int64_t bits, int64_t group_size, const std::optional<at::Tensor>& codebook) {
  if (group_size % kBlock != 0) return false;
  if (bits == 8) return true;
  return bits == 4 && codebook && codebook->scalar_type() == at::kFloat && codebook->is_contiguous() &&
         codebook->numel() == 16 && affine_codebook_offset(codebook->const_data_ptr<float>()).has_value();
}

// x [M, K] quantized in blocks of 32; every per-row array runs over K padded to kPad.
struct Int8Rows {
  int64_t M = 0, K = 0, K_pad = 0, groups = 0;
  std::vector<int8_t> codes;           // [M, K_pad]
  std::vector<float> lane_scales;      // [M, K_pad / 4]: each lane's block scale d (one vector load); empty unless asked
  std::vector<float> block_scales;     // [M, blocks_pad()]: each block's d in x's order (not nibble_order's), 0 past K
  std::vector<int32_t> lane_offsets;   // [M, K_pad / 4]: c * (the lane's 4 codes' sum); empty for c = 0
  std::vector<float> group_sums;       // [M, groups]: sum of x over each weight group; empty without mins
  std::vector<int32_t> block_code_sums;  // [M, blocks_pad()]: each block's sum of codes; empty unless asked

  const int8_t* codes_of(int64_t m) const { return codes.data() + m * K_pad; }
  int64_t blocks_pad() const { return (K_pad / kBlock + 7) / 8 * 8; }  // whole vectors of 8 scales
  const float* block_scales_of(int64_t m) const { return block_scales.data() + m * blocks_pad(); }
  const int32_t* offsets_of(int64_t m) const {
    return lane_offsets.empty() ? nullptr : lane_offsets.data() + m * (K_pad / kLane);
  }
  const float* sums_of(int64_t m) const { return group_sums.empty() ? nullptr : group_sums.data() + m * groups; }
  const int32_t* code_sums_of(int64_t m) const { return block_code_sums.data() + m * blocks_pad(); }
};

// One block of 32 inputs at a time, 8 lanes at a time where there is AVX2 (both x86 tiers' flags
// include it; the scalar loop after it is the same rule elsewhere). Scalar code cost 1.6-2 ns an
// input here, serially before every int8 matmul: a tenth of a 16-row decode step (ep-2c, 2
// threads). The codes and scales are the scalar formulas' (fp32 max, divisions and product, round
// half to even); a group's sum of x adds 8 lanes per block, then the lanes (an order of its own,
// the same for every row and batch).
#ifdef __AVX2__
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t group_size, int offset, bool sums, int8_t* codes, float* scales,
                  float* block_scales, int32_t* offsets, float* group_sums, int32_t* code_sums) {
  using namespace pagedllm_vec_avx2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  const int64_t per_group = group_size / kBlock;
  __m256 group_sum = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + b * kBlock + 8 * i);
    const __m256 abs_max = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                         _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = hmax(abs_max);
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    block_scales[b] = d;
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvttps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * kBlock), packed);
    if (scales != nullptr) _mm256_storeu_ps(scales + b * (kBlock / kLane), _mm256_set1_ps(d));
    if (offsets != nullptr || code_sums != nullptr) {
      // Each lane's 4 codes summed: bytes times 1 in pairs, then the pairs.
      const __m256i lane_sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, packed), ones16);
      if (offsets != nullptr)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(offsets + b * (kBlock / kLane)),
                            _mm256_mullo_epi32(lane_sums, _mm256_set1_epi32(offset)));
      if (code_sums != nullptr) {
        const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(lane_sums), _mm256_extracti128_si256(lane_sums, 1));
        const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
        code_sums[b] = _mm_cvtsi128_si32(quarter) + _mm_extract_epi32(quarter, 1);
      }
    }
    if (sums) {
      group_sum = _mm256_add_ps(group_sum, _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      if ((b + 1) % per_group == 0) {
        group_sums[b / per_group] = hsum(group_sum);
        group_sum = _mm256_setzero_ps();
      }
    }
  }
}
#else
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t group_size, int offset, bool sums, int8_t* codes, float* scales,
                  float* block_scales, int32_t* offsets, float* group_sums, int32_t* code_sums) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float v[kBlock];
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) {
      v[j] = static_cast<float>(x[b * kBlock + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    block_scales[b] = d;
    int8_t* q = codes + b * kBlock;
    int32_t block_sum = 0;
    for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
    for (int l = 0; l < kBlock / kLane; ++l) {
      if (scales) scales[b * kBlock / kLane + l] = d;
      int32_t lane_sum = 0;
      for (int j = 0; j < kLane; ++j) lane_sum += q[l * kLane + j];
      if (offsets) offsets[b * kBlock / kLane + l] = offset * lane_sum;
      block_sum += lane_sum;
    }
    if (code_sums) code_sums[b] = block_sum;
  }
  if (sums) {
    for (int64_t g = 0; g < K / group_size; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += static_cast<float>(x[k]);
      group_sums[g] = s;
    }
  }
}
#endif

// The 4-bit codes' order (nibble_order): per 64 inputs, the second and third runs of 16 swapped,
// [0-15, 32-47, 16-31, 48-63], as the low nibbles of two runs of 32 and then their high ones lie in
// 32 bytes: one broadcast load and a shift of its upper half give the codes in x's order. The
// lanes' scales and offsets move with their codes; the group sums do not depend on the order.
template <typename T>
void swap_middle_runs(T* per_64, int64_t count_per_run, int64_t runs_of_64) {
  for (int64_t p = 0; p < runs_of_64; ++p)
    std::swap_ranges(per_64 + (4 * p + 1) * count_per_run, per_64 + (4 * p + 2) * count_per_run,
                     per_64 + (4 * p + 2) * count_per_run);
}

// What a kernel reads of x's rows besides the codes and block scales (each array costs its memory
// and its stores: a prefill chunk's lane scales would be as large as its codes).
struct Int8RowsParts {
  bool sums = false;          // group_sums (the weights have mins)
  bool nibble_order = false;  // the codes, lane scales and offsets in the 4-bit codes' order
  bool code_sums = false;     // block_code_sums
  bool lane_scales = false;   // lane_scales
};

// x: float32 or bfloat16 [M, K] with contiguous rows, K a multiple of 32. offset: the weights' c
// (0: no lane offsets).
inline Int8Rows quantize_rows(const at::Tensor& x, int64_t group_size, int offset, Int8RowsParts parts) {
  Int8Rows rows;
  rows.M = x.size(0), rows.K = x.size(1), rows.K_pad = (rows.K + kPad - 1) / kPad * kPad;
  rows.groups = rows.K / group_size;
  const int64_t lanes = rows.K_pad / kLane;
  rows.codes.assign(rows.M * rows.K_pad, 0);
  if (parts.lane_scales) rows.lane_scales.assign(rows.M * lanes, 0.0f);
  rows.block_scales.assign(rows.M * rows.blocks_pad(), 0.0f);
  if (offset != 0) rows.lane_offsets.assign(rows.M * lanes, 0);
  if (parts.sums) rows.group_sums.assign(rows.M * rows.groups, 0.0f);
  if (parts.code_sums) rows.block_code_sums.assign(rows.M * rows.blocks_pad(), 0);
  // Rows in parallel where there are many (a prefill chunk's); a decode step's few take microseconds.
  at::parallel_for(0, rows.M, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(rows.K, 1)),
                   [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      int32_t* offsets = offset != 0 ? rows.lane_offsets.data() + m * lanes : nullptr;
      float* group_sums = parts.sums ? rows.group_sums.data() + m * rows.groups : nullptr;
      int32_t* block_sums = parts.code_sums ? rows.block_code_sums.data() + m * rows.blocks_pad() : nullptr;
      float* lane_scales = parts.lane_scales ? rows.lane_scales.data() + m * lanes : nullptr;
      auto run = [&](const auto* xr) {
        quantize_row(xr, rows.K, group_size, offset, parts.sums, rows.codes.data() + m * rows.K_pad, lane_scales,
                     rows.block_scales.data() + m * rows.blocks_pad(), offsets, group_sums, block_sums);
      };
      if (x.scalar_type() == at::kBFloat16) run(x.const_data_ptr<c10::BFloat16>() + m * x.stride(0));
      else run(x.const_data_ptr<float>() + m * x.stride(0));
      if (parts.nibble_order) {
        const int64_t runs_of_64 = rows.K_pad / 64;
        swap_middle_runs(rows.codes.data() + m * rows.K_pad, 16, runs_of_64);
        if (lane_scales) swap_middle_runs(lane_scales, 16 / kLane, runs_of_64);
        if (offsets) swap_middle_runs(offsets, 16 / kLane, runs_of_64);
      }
    }
  });
  return rows;
}

// How many rows of x an interleaved kernel multiplies with every weight row before the next rows:
// about 150 KB of codes, which stay in L2 while the weights pass them (256 rows of 576 inputs).
// A prefill chunk's thousands of rows otherwise stream from L3 past each group of weight rows:
// 1.10x at 2888 rows on ep-2c (Zen 4, 1 MB of L2 a core).
inline int64_t rows_per_l2_block(const Int8Rows& rows) {
  return std::max<int64_t>(16, (int64_t{150} << 10) / std::max<int64_t>(rows.K_pad, 1));
}

// The row-interleaved layout (pagedllm/model/quant_weight.py, QuantizedWeight.interleave): 16 weight
// rows to a vector, so each int32 lane of a dot product sums for one row. Per 16 rows and block of
// 32 inputs, chunks of 64 bytes (16 rows x 4 bytes): 4-bit codes take 4, chunk c's lane j holding
// row j's bytes 4c..4c+3 of the plain layout (low nibbles: inputs 4c..4c+3, high ones: 16+4c..
// 16+4c+3); int8 codes take 8, chunk c's lane j row j's codes 4c..4c+3. codes [N/16, K/32, 256 or
// 512] uint8, scales and mins [N/16, groups, 16].
constexpr int64_t kInterleavedRows = 16;

// Row-interleaved weights as the kernels read them, checked.
struct InterleavedWeights {
  const uint8_t* codes;
  int64_t groups16, block_bytes;
  int64_t blocks, groups;  // of 32 inputs, of group_size inputs, per row
};

inline InterleavedWeights check_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                            const std::optional<at::Tensor>& mins,
                                            const std::optional<at::Tensor>& codebook, int64_t bits,
                                            int64_t group_size, const std::optional<at::Tensor>& bias,
                                            const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be float32 or bfloat16 [M, K] with contiguous rows, out [M, N] of its dtype");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out.size(1)),
              "quant_linear: bias must be contiguous float32 [N]");
  const int64_t K = x.size(1), groups16 = qweight.size(0), block_bytes = bits == 4 ? 256 : 512;
  TORCH_CHECK(int8_layout(bits, group_size, codebook) && K % group_size == 0,
              "quant_linear: interleaved weights need int8 codes or 4-bit consecutive codes, groups of 32k");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) == K / kBlock && qweight.size(2) == block_bytes,
              "quant_linear: interleaved codes must be contiguous [N/16, K/32, ", block_bytes, "]");
  auto check_groups = [&](const at::Tensor& t) {
    TORCH_CHECK(t.is_contiguous() && t.dim() == 3 && t.size(0) == groups16 && t.size(1) == K / group_size &&
                    t.size(2) == kInterleavedRows && t.scalar_type() == scales.scalar_type() &&
                    (t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat),
                "quant_linear: interleaved scales and mins must be contiguous float16 or float32 [N/16, groups, 16]");
  };
  check_groups(scales);
  if (mins) check_groups(*mins);
  TORCH_CHECK(out.size(1) == groups16 * kInterleavedRows, "quant_linear: out must have N columns");
  return {static_cast<const uint8_t*>(qweight.const_data_ptr()), groups16, block_bytes, K / kBlock, K / group_size};
}

// f(is_u4, with_min, codes, scales, mins, out, n0, count, m_begin, m_end) for every run of `step`
// groups of 16 weight rows (count of them: step, or fewer at the end; n0 the first output column;
// scales, mins, out: typed pointers of the first group's variant, the next groups' codes, scales
// and mins one group's stride on) and every block of x's rows [m_begin, m_end) (rows_per_l2_block:
// all groups pass one block before the next), on every thread: chunks of groups taken in turn, not
// a fixed share per thread (a VM's cores run at different speeds from one call to the next; a
// static split waits on the slower).
template <typename F>
void for_each_interleaved_group(const InterleavedWeights& w, int64_t bits, const at::Tensor& scales,
                                const std::optional<at::Tensor>& mins, const Int8Rows& x, at::Tensor& out, F&& f,
                                int64_t step = 1) {
  auto run = [&](auto is_u4, auto with_min, const auto* sp, auto* op) {
    const auto* mp = mins ? static_cast<decltype(sp)>(mins->const_data_ptr()) : nullptr;
    const int64_t group_stride = w.groups * kInterleavedRows, codes_stride = w.blocks * w.block_bytes;
    const int64_t runs = (w.groups16 + step - 1) / step;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), runs);
    const int64_t chunk = step * std::max<int64_t>(1, runs / (8 * std::max<int64_t>(threads, 1)));
    for (int64_t m_begin = 0, m_end = 0; m_begin < x.M; m_begin = m_end) {
      m_end = std::min(x.M, m_begin + rows_per_l2_block(x));
      std::atomic<int64_t> next{0};
      at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t g0 = next.fetch_add(chunk); g0 < w.groups16; g0 = next.fetch_add(chunk))
          for (int64_t g = g0; g < std::min(w.groups16, g0 + chunk); g += step)
            f(is_u4, with_min, w.codes + g * codes_stride, sp + g * group_stride,
              mp ? mp + g * group_stride : nullptr, op, g * kInterleavedRows, std::min(step, w.groups16 - g), m_begin,
              m_end);
      });
    }
  };
  auto by_output = [&](auto is_u4, auto with_min, const auto* sp) {
    if (out.scalar_type() == at::kFloat) run(is_u4, with_min, sp, out.mutable_data_ptr<float>());
    else run(is_u4, with_min, sp, out.mutable_data_ptr<c10::BFloat16>());
  };
  auto by_scales = [&](auto is_u4, auto with_min) {
    if (scales.scalar_type() == at::kHalf) by_output(is_u4, with_min, scales.const_data_ptr<c10::Half>());
    else by_output(is_u4, with_min, scales.const_data_ptr<float>());
  };
  auto by_min = [&](auto is_u4) {
    if (mins) by_scales(is_u4, std::true_type{});
    else by_scales(is_u4, std::false_type{});
  };
  if (bits == 4) by_min(std::true_type{});
  else by_min(std::false_type{});
}

// The same product over row-interleaved weights (codes.dim() == 3): quant_int8_avx512.cpp (AVX-512
// VNNI) and quant_int8_avx2.cpp define it; false where neither is compiled.
bool quant_linear_int8_interleaved(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook,
                                   int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias,
                                   at::Tensor& out);

// out = x @ W^T (+ bias) through int8 activations where the layout takes them (int8_layout): true
// once done, false (nothing written) where it does not. Defined by the tier's kernel file.
bool quant_linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                       int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out);

}  // namespace pagedllm_int8
