// Matmuls over quantized weights (the layouts quant_matmul.cpp describes: 4-bit codes in runs of
// 32 indexing a 16-value codebook, or int8 codes; a float16 or float32 scale, and maybe a min, per
// group) in plain C++, for the tiers without AVX-512: the compiler vectorizes the loops for the
// tier's -m flags (AVX2 with FMA here; the same source compiles for aarch64).
//
// quant_linear: weights decoded to exactly the float32 values gguf's dequantizer gives (scale *
// value, exact, then + min), multiplied with x in fp32. With AVX2 (row_dots) a weight row is
// decoded in registers and multiplied with 8 rows of x at a time; elsewhere each weight row is
// decoded into a buffer (K floats) and dotted with every row of x (16 partial sums). quant_dequantize: the same decode,
// stored (the tiles QuantLinear multiplies with torch's GEMM for many rows, and embeddings).
// With AVX2, bf16 x goes through int8 activations and integer dot products instead
// (quant_int8_avx2.cpp) where the layout allows (quant_int8_rows.h); float32 x stays exact.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifdef __AVX2__
#include <immintrin.h>

#include "vec_avx2.h"
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "generic_quant_layout.h"
#include "ops.h"
#include "quant_int8_rows.h"

namespace {
using pagedllm_generic::Layout;
using pagedllm_generic::make_layout;

// Weight row n as float32 into w[K]: scale * value (exact) + min, one rounding.
void decode_row(const Layout& l, int64_t n, float* w) {
  const uint8_t* row = l.codes + n * l.row_bytes;
  if (l.bits == 8) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(row);
    for (int64_t g = 0; g < l.K / l.G; ++g) {
      const float s = l.scale(n, g), m = l.min(n, g);
      for (int64_t k = g * l.G; k < (g + 1) * l.G; ++k) w[k] = s * static_cast<float>(codes[k]) + m;
    }
    return;
  }
  // 4-bit: the run of 32 inputs k0.. holds k0 + j in byte j's low nibble, k0 + 16 + j in its high;
  // each half of a run lies in one group (groups are 16 or a multiple of 32 inputs).
  for (int64_t k0 = 0; k0 < l.K; k0 += 32) {
    const uint8_t* bytes = row + k0 / 2;
    const int64_t g_lo = k0 / l.G, g_hi = (k0 + 16) / l.G;
    const float s_lo = l.scale(n, g_lo), s_hi = l.scale(n, g_hi), m_lo = l.min(n, g_lo), m_hi = l.min(n, g_hi);
    for (int j = 0; j < 16; ++j) {
      w[k0 + j] = s_lo * l.book[bytes[j] & 15] + m_lo;
      w[k0 + 16 + j] = s_hi * l.book[bytes[j] >> 4] + m_hi;
    }
  }
}

inline float dot(const float* x, const float* w, int64_t K) {
  float partial[16] = {};
  for (int64_t k = 0; k < K; k += 16)  // K is a multiple of 16 (the group sizes)
    for (int j = 0; j < 16; ++j) partial[j] += x[k + j] * w[k + j];
  float sum = 0.0f;
  for (float p : partial) sum += p;
  return sum;
}

#ifdef __AVX2__
// With AVX2: each weight row decoded 8 values at a time in registers and multiplied with up to
// kRows rows of x as it goes (no buffer). 4-bit codes index the group's table scale * book + min
// (16 values in two registers) with two permutes and a blend on the code's bit 3.
constexpr int kRows = 8;
using pagedllm_vec_avx2::hsum;

template <int R>
inline void fma_rows(__m256 w, const float* x, int64_t ldx, int64_t k, __m256* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + k), acc[r]);
}

// 8 table values for 8 codes (0..15) in 32-bit lanes.
inline __m256 lookup(__m256 lo8, __m256 hi8, __m256i idx) {
  const __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // sign bit: code >= 8
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, idx), _mm256_permutevar8x32_ps(hi8, idx), high);
}

// sums[r] = x[r] . w[n] for R rows of x (rows ldx apart).
template <int R>
void row_dots(const Layout& l, int64_t n, const float* x, int64_t ldx, float* sums) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* row = l.codes + n * l.row_bytes;
  if (l.bits == 8) {
    for (int64_t g = 0; g < l.K / l.G; ++g) {
      const __m256 s = _mm256_set1_ps(l.scale(n, g)), m = _mm256_set1_ps(l.min(n, g));
      for (int64_t k = g * l.G; k < (g + 1) * l.G; k += 8) {
        const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
        fma_rows<R>(_mm256_add_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(codes)), m), x, ldx, k, acc);
      }
    }
  } else {
    const __m256 book_lo = _mm256_loadu_ps(l.book), book_hi = _mm256_loadu_ps(l.book + 8);
    int64_t table_group = -1;
    __m256 t_lo[2], t_hi[2];  // the tables of the run's two halves (a group of 16 is half a run)
    for (int64_t k0 = 0; k0 < l.K; k0 += 32) {
      for (int half = 0; half < 2; ++half) {
        const int64_t g = (k0 + 16 * half) / l.G;
        if (g != table_group || l.G == 16) {
          const __m256 s = _mm256_set1_ps(l.scale(n, g)), m = _mm256_set1_ps(l.min(n, g));
          t_lo[half] = _mm256_add_ps(_mm256_mul_ps(s, book_lo), m);
          t_hi[half] = _mm256_add_ps(_mm256_mul_ps(s, book_hi), m);
          table_group = g;
        } else {
          t_lo[half] = t_lo[0], t_hi[half] = t_hi[0];
        }
      }
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
      const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(15));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
      fma_rows<R>(lookup(t_lo[0], t_hi[0], _mm256_cvtepu8_epi32(low)), x, ldx, k0, acc);
      fma_rows<R>(lookup(t_lo[0], t_hi[0], _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), x, ldx, k0 + 8, acc);
      fma_rows<R>(lookup(t_lo[1], t_hi[1], _mm256_cvtepu8_epi32(high)), x, ldx, k0 + 16, acc);
      fma_rows<R>(lookup(t_lo[1], t_hi[1], _mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), x, ldx, k0 + 24, acc);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]);
}
#endif

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

}  // namespace

// The entry points (quant_linear is ops.h's: decode_layers.cpp calls it directly).
namespace pagedllm_ops {

void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                  int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  if (qweight.dim() == 3) {  // row-interleaved (quant_int8_rows.h): the int8 kernel alone reads it
    TORCH_CHECK(pagedllm_int8::quant_linear_int8_interleaved(x, qweight, scales, mins, codebook, bits, group_size, bias, out),
                "quant_linear: row-interleaved weights need AVX2 or AVX-512 VNNI (QuantizedWeight.plain() undoes them)");
    return;
  }
  const Layout l = make_layout(qweight, scales, mins, codebook, bits, group_size);
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == l.K, "quant_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_linear: float32 or bfloat16 x");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == l.N && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "quant_linear: out must be [M, N] of x's dtype with contiguous rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == l.N),
              "quant_linear: bias must be contiguous float32 [N]");
#ifdef __AVX2__
  if (x.scalar_type() == at::kBFloat16 &&
      pagedllm_int8::quant_linear_int8(x, qweight, scales, mins, codebook, bits, group_size, bias, out))
    return;
#endif
  const at::Tensor x32 = (x.scalar_type() == at::kFloat ? x : x.to(at::kFloat)).contiguous();
  const float* xp = x32.const_data_ptr<float>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t ldo = out.stride(0);
  auto run = [&](auto* op) {
    const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(l.K, 1));
    at::parallel_for(0, l.N, grain, [&](int64_t n0, int64_t n1) {
#ifdef __AVX2__
      float sums[kRows];
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        const float* xm = xp + m0 * l.K;
        for (int64_t n = n0; n < n1; ++n) {
          switch (rows) {  // the row count as a constant: the accumulators stay in registers
            case 8: row_dots<8>(l, n, xm, l.K, sums); break;
            case 7: row_dots<7>(l, n, xm, l.K, sums); break;
            case 6: row_dots<6>(l, n, xm, l.K, sums); break;
            case 5: row_dots<5>(l, n, xm, l.K, sums); break;
            case 4: row_dots<4>(l, n, xm, l.K, sums); break;
            case 3: row_dots<3>(l, n, xm, l.K, sums); break;
            case 2: row_dots<2>(l, n, xm, l.K, sums); break;
            default: row_dots<1>(l, n, xm, l.K, sums); break;
          }
          for (int r = 0; r < rows; ++r) store(op + (m0 + r) * ldo + n, sums[r] + (bp ? bp[n] : 0.0f));
        }
      }
#else
      std::vector<float> w(l.K);
      for (int64_t n = n0; n < n1; ++n) {
        decode_row(l, n, w.data());
        for (int64_t r = 0; r < M; ++r) store(op + r * ldo + n, dot(xp + r * l.K, w.data(), l.K) + (bp ? bp[n] : 0.0f));
      }
#endif
    });
  };
  if (out.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
  else run(out.mutable_data_ptr<c10::BFloat16>());
}

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                            at::ScalarType dtype) {
  const Layout l = make_layout(qweight, scales, mins, codebook, bits, group_size);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: float32 or bfloat16 out");
  at::Tensor out = at::empty({l.N, l.K}, qweight.options().dtype(dtype));
  auto run = [&](auto* op) {
    at::parallel_for(0, l.N, std::max<int64_t>(1, (int64_t{1} << 16) / l.K), [&](int64_t n0, int64_t n1) {
      std::vector<float> w(l.K);
      for (int64_t n = n0; n < n1; ++n) {
        decode_row(l, n, w.data());
        for (int64_t k = 0; k < l.K; ++k) store(op + n * l.K + k, w[k]);
      }
    });
  };
  if (dtype == at::kFloat) run(out.mutable_data_ptr<float>());
  else run(out.mutable_data_ptr<c10::BFloat16>());
  return out;
}

// Whether quant_linear takes bf16 activations of this weight layout as int8 (quant_int8_rows.h).
bool quant_int8_takes(const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size) {
#ifdef __AVX2__
  return pagedllm_int8::int8_layout(bits, group_size, codebook);
#else
  return false;
#endif
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_int8_takes", &pagedllm_ops::quant_int8_takes);  // no tensor to dispatch on: every backend
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("quant_linear", &pagedllm_ops::quant_linear);
  m.impl("quant_dequantize", &pagedllm_ops::quant_dequantize);
}
