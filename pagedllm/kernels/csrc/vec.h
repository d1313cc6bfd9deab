// Small AVX-512 helpers shared by the CPU kernels: fp32 <-> storage dtype, exp and tanh.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <cstdint>

namespace pagedllm_vec {

inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_f32(const c10::BFloat16* p) {
  __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Compressed KV codes, 16 at a time (their scales, where they have any, are applied by the caller).
inline __m512 load_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// fp8 e5m2 is the top byte of an fp16 (same exponent bias): shift it up and convert.
inline __m512 load_f32(const c10::Float8_e5m2* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}

// fp8 e4m3 (s eeee mmm, bias 7): the byte sign-extended to 32 bits and shifted left by 20 puts e
// and m where an fp32 keeps its exponent's low bits and its mantissa's top bits, the sign copies in
// bits 27-31; masked to bit 31 and those, it is an fp32 of 2^-120 times the value, subnormals too
// (they become fp32 subnormals: a DAZ mode would flush them, codes under 2^-6, to zero).
// Four instructions for 16 codes.
inline __m512 load_f32(const c10::Float8_e4m3fn* p) {
  const __m512i shifted = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 20);
  const __m512 scaled = _mm512_castsi512_ps(_mm512_and_si512(shifted, _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
  return _mm512_mul_ps(scaled, _mm512_set1_ps(0x1p120f));
}

inline void store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// Round to nearest even, as torch does when casting float32 to bfloat16 (NaN aside).
inline __m256i to_bf16_bits(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

inline void store_f32(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}

// exp(x): exactly 0 below about -87 (so exp(-inf) = 0), clamped to exp(88) above.
inline __m512 exp_f32(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
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

// tanh(x) = 1 - 2 / (exp(2x) + 1): exactly +-1 far out (exp_f32 clamps, the division saturates);
// near 0 the absolute error stays at a float epsilon.
inline __m512 tanh_f32(__m512 x) {
  const __m512 e = exp_f32(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load_f32(const c10::BFloat16* p, __mmask16 m) {
  __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store_f32(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store_f32(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

// v rounded to T and back: what storing in T and loading again gives (identity for float).
inline __m512 round_to(const float*, __m512 v) { return v; }

inline __m512 round_to(const c10::BFloat16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

}  // namespace pagedllm_vec
