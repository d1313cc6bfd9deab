// The packed quantized weights as the CPU kernels read them (quant_matmul.cpp, quant_amx.cpp): the
// layouts (described in quant_matmul.cpp and pagedllm/model/quant_weight.py), checks, the
// compile-time variant dispatch, and dequantization of a row.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "vec.h"

// Internal linkage in each source that includes it: the small helpers then inline (an exported
// one is called through the PLT under -fPIC).
namespace pagedllm_quant {
namespace {
using namespace pagedllm_vec;
using BF16 = c10::BFloat16;

inline float to_f32(float v) { return v; }
inline float to_f32(c10::Half v) { return _mm_cvtss_f32(_mm_maskz_cvtph_ps(1, _mm_cvtsi32_si128(v.x))); }

// 16 (or, under mask m, fewer) consecutive per-group values as fp32.
inline __m512 load_groups(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_groups(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

template <typename S>
struct Packed {
  const uint8_t* q;       // codes: u4 [N, K/2] bytes, i8 [N, K]
  const S* scales;        // [N, groups]
  const S* mins;          // [N, groups] or nullptr
  const float* book;      // u4: 16 floats; i8: nullptr
  int64_t K, groups, group_size, row_bytes;

  float scale(int64_t row, int64_t g) const { return to_f32(scales[row * groups + g]); }
  float min(int64_t row, int64_t g) const { return to_f32(mins[row * groups + g]); }
};

inline __m512 fma_or_mul(__m512 a, __m512 b, __m512 c, bool with_c) {
  return with_c ? _mm512_fmadd_ps(a, b, c) : _mm512_mul_ps(a, b);
}

// The 16 dequantized values a u4 group's codes stand for.
template <bool kMin, typename S>
inline __m512 u4_table(const Packed<S>& w, __m512 book, int64_t row, int64_t g) {
  const __m512 scale = _mm512_set1_ps(w.scale(row, g));
  return kMin ? _mm512_fmadd_ps(scale, book, _mm512_set1_ps(w.min(row, g))) : _mm512_mul_ps(scale, book);
}

template <typename S>
inline __m512i u4_codes(const Packed<S>& w, int64_t row, int64_t chunk) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + row * w.row_bytes + chunk * 16)));
}

// Calls f(chunk, group of its low 16 codes, group of its high 16, whether a group starts) for
// each run of 32 inputs.
template <typename S, typename F>
__attribute__((always_inline)) inline void for_each_u4_chunk(const Packed<S>& w, F&& f) {
  if (w.group_size == 16) {
    for (int64_t c = 0; c < w.K / 32; ++c) f(c, 2 * c, 2 * c + 1, true);
  } else if (w.group_size == 32) {
    for (int64_t g = 0; g < w.groups; ++g) f(g, g, g, true);
  } else {
    const int64_t per_group = w.group_size / 32;
    for (int64_t g = 0; g < w.groups; ++g)
      for (int64_t c = 0; c < per_group; ++c) f(g * per_group + c, g, g, c == 0);
  }
}

template <typename S>
inline __m512 i8_codes(const Packed<S>& w, int64_t row, int64_t k) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + row * w.row_bytes + k))));
}

struct Weights {
  const at::Tensor& qweight;
  const at::Tensor& scales;
  const std::optional<at::Tensor>& mins;
  const std::optional<at::Tensor>& codebook;
  int64_t bits, group_size;
};

template <typename S>
Packed<S> make_packed(const Weights& t) {
  TORCH_CHECK(t.bits == 4 || t.bits == 8, "quantized weights: bits must be 4 or 8");
  TORCH_CHECK(t.qweight.dim() == 2 && t.qweight.is_contiguous() && t.qweight.element_size() == 1,
              "quantized weights: codes must be a contiguous [N, bytes] uint8/int8 tensor");
  const int64_t N = t.qweight.size(0);
  const int64_t K = t.bits == 4 ? t.qweight.size(1) * 2 : t.qweight.size(1);
  const int64_t G = t.group_size;
  TORCH_CHECK(G > 0 && K % G == 0, "quantized weights: group size must divide K");
  TORCH_CHECK(t.bits == 8 ? G % 16 == 0 : (G == 16 || G % 32 == 0),
              "quantized weights: group size must be a multiple of 16 (int8) or 16 or 32k (4-bit)");
  TORCH_CHECK(t.bits == 8 || K % 32 == 0, "quantized weights: 4-bit K must be a multiple of 32");
  auto check_groups = [&](const at::Tensor& s, const char* name) {
    TORCH_CHECK(s.scalar_type() == t.scales.scalar_type() && s.is_contiguous() && s.dim() == 2 && s.size(0) == N &&
                    s.size(1) == K / G,
                "quantized weights: ", name, " must be contiguous [N, K / group_size] of one float dtype");
  };
  check_groups(t.scales, "scales");
  if (t.mins) check_groups(*t.mins, "mins");
  TORCH_CHECK(t.bits == 8 || (t.codebook && t.codebook->scalar_type() == at::kFloat && t.codebook->is_contiguous() &&
                              t.codebook->numel() == 16),
              "quantized weights: 4-bit codes need a contiguous float32 codebook of 16 values");
  return Packed<S>{static_cast<const uint8_t*>(t.qweight.data_ptr()),
                   static_cast<const S*>(t.scales.data_ptr()),
                   t.mins ? static_cast<const S*>(t.mins->data_ptr()) : nullptr,
                   t.bits == 4 ? t.codebook->const_data_ptr<float>() : nullptr,
                   K, K / G, G, t.qweight.size(1)};
}

// Calls f(packed, is_u4, with_min) with the compile-time variant of these weights.
template <typename F>
void dispatch(const Weights& t, F&& f) {
  auto by_format = [&](auto scale_tag) {
    using S = typename decltype(scale_tag)::type;
    const Packed<S> w = make_packed<S>(t);
    const bool u4 = t.bits == 4, with_min = w.mins != nullptr;
    if (u4 && with_min) f(w, std::true_type{}, std::true_type{});
    else if (u4) f(w, std::true_type{}, std::false_type{});
    else if (with_min) f(w, std::false_type{}, std::true_type{});
    else f(w, std::false_type{}, std::false_type{});
  };
  if (t.scales.scalar_type() == at::kHalf) by_format(std::type_identity<c10::Half>{});
  else if (t.scales.scalar_type() == at::kFloat) by_format(std::type_identity<float>{});
  else TORCH_CHECK(false, "quantized weights: scales must be float16 or float32");
}

// 32 consecutive values, rounded to T.
inline void store_pair(float* out, __m512 first, __m512 second) {
  _mm512_storeu_ps(out, first);
  _mm512_storeu_ps(out + 16, second);
}

inline void store_pair(BF16* out, __m512 first, __m512 second) {
#ifdef __AVX512BF16__
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(second, first));  // round to nearest even
#else
  store_f32(out, first);
  store_f32(out + 16, second);
#endif
}

// The per-group values (scales or mins) of one row, as fp32 broadcast to every lane: converted 16
// groups at a time into a small array, each then broadcast from memory (a load, not a shuffle: the
// shuffle port is the one the codes' permutes keep busy).
template <typename S>
class RowGroups {
 public:
  RowGroups(const S* values, int64_t groups) : values_(values), groups_(groups) {}

  __attribute__((always_inline)) __m512 operator()(int64_t g) {
    if (g < base_ || g >= base_ + 16) {
      base_ = g / 16 * 16;
      _mm512_store_ps(cached_, load_groups(values_ + base_, tail_mask(groups_ - base_)));
    }
    return _mm512_set1_ps(cached_[g - base_]);
  }

 private:
  const S* values_;
  int64_t groups_;
  int64_t base_ = -16;
  alignas(64) float cached_[16] = {};
};

// One row of W dequantized to T (float32 or bfloat16): input k goes to out[k / 32 * chunk_stride +
// k % 32] (chunk_stride 32: the plain row; larger: runs of 32 inputs spread out, as AMX tiles
// want them).
template <bool kU4, bool kMin, typename S, typename T>
void dequantize_row(const Packed<S>& w, int64_t row, T* out, int64_t chunk_stride = 32) {
  RowGroups<S> scales(w.scales + row * w.groups, w.groups);
  RowGroups<S> mins(kMin ? w.mins + row * w.groups : w.scales, w.groups);
  auto value = [&](__m512 codes, int64_t g) __attribute__((always_inline)) {  // scale * codes + min, one rounding
    return kMin ? _mm512_fmadd_ps(scales(g), codes, mins(g)) : _mm512_mul_ps(scales(g), codes);
  };
  if constexpr (kU4) {
    const __m512 book = _mm512_loadu_ps(w.book);
    __m512 lo_tab = book, hi_tab = book;
    for_each_u4_chunk(w, [&](int64_t c, int64_t g_lo, int64_t g_hi, bool new_group) __attribute__((always_inline)) {
      if (new_group) {
        lo_tab = value(book, g_lo);
        hi_tab = g_hi == g_lo ? lo_tab : value(book, g_hi);
      }
      if (c % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(w.q + (row + 2) * w.row_bytes + c * 16), _MM_HINT_T0);
      const __m512i codes = u4_codes(w, row, c);
      store_pair(out + c * chunk_stride, _mm512_permutexvar_ps(codes, lo_tab),
                 _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), hi_tab));
    });
  } else {
    __m512 first = _mm512_setzero_ps();  // the first 16 of a run of 32, stored with the second
    for (int64_t g = 0; g < w.groups; ++g) {
      for (int64_t k = g * w.group_size; k < (g + 1) * w.group_size; k += 16) {
        if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w.q + (row + 2) * w.row_bytes + k), _MM_HINT_T0);
        const __m512 v = value(i8_codes(w, row, k), g);
        if (k % 32 == 0) first = v;
        else store_pair(out + k / 32 * chunk_stride, first, v);
      }
    }
    if (w.K % 32) store_f32(out + w.K / 32 * chunk_stride, first);  // a last half run
  }
}

}  // namespace
}  // namespace pagedllm_quant
