// Small AVX2 helpers shared by the AVX2 tier's kernels (attention_avx2.cpp, quant_int8_avx2.cpp,
// generic_quant.cpp, generic_fused_ops.cpp): 8 stored elements as fp32 and back, horizontal sum and
// max, exp and tanh. vec.h is their AVX-512 counterpart (16 lanes), with the same formulas.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <cstdint>

namespace pagedllm_vec_avx2 {

// 8 elements of a row as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// fp8 e5m2 is the top byte of an fp16 (same exponent bias).
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}

// fp8 e4m3: sign-extended and shifted so e and m sit in an fp32's low exponent and top mantissa
// bits, masked to them and the sign: 2^-120 times the value (vec.h's AVX-512 load says more).
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i shifted =
      _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
  const __m256 scaled =
      _mm256_castsi256_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
  return _mm256_mul_ps(scaled, _mm256_set1_ps(0x1p120f));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// v rounded to bf16 (nearest even, NaN to a quiet NaN, as c10::BFloat16 converts): 8 bit patterns.
inline __m128i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// v as stored in T and read back (torch's casts round to the storage dtype between ops).
inline __m256 round8(const float*, __m256 v) { return v; }
inline __m256 round8(const c10::BFloat16*, __m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v)); }

// exp(x): 0 below about -87 (exp(-inf) = 0), clamped at exp(88): Taylor to degree 7 around the
// nearest multiple of ln 2, as vec.h's exp_f32 on AVX-512.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 alive = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 q = _mm256_set1_ps(1.0f / 5040);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 720));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 120));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 24));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f / 6));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
  // 2^n built in the exponent field: n is in [-126, 127] after the clamps, a normal float.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(alive, _mm256_mul_ps(q, _mm256_castsi256_ps(bits)));
}

// tanh(x) = 1 - 2 / (exp(2x) + 1).
inline __m256 tanh8(__m256 x) {
  const __m256 e = exp8(_mm256_add_ps(x, x));
  return _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
}

}  // namespace pagedllm_vec_avx2
