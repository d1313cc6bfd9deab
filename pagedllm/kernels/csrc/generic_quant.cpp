// Matmuls over quantized weights (the layouts quant_matmul.cpp describes: 4-bit codes in runs of
// 32 indexing a 16-value codebook, or int8 codes; a float16 or float32 scale, and maybe a min, per
// group) in plain C++, for the tiers without AVX-512: the compiler vectorizes the loops for the
// tier's -m flags (AVX2 with FMA here; the same source compiles for aarch64).
//
// quant_linear: each task decodes one weight row at a time into a buffer (K floats, in L1/L2),
// exactly the float32 values gguf's dequantizer gives (scale * value + min, scale * value exact),
// and takes its dot product with every row of x (16 partial sums, one vector register's lanes):
// the weight is read once per call whatever the row count. quant_dequantize: the same decode,
// stored (the tiles QuantLinear multiplies with torch's GEMM for many rows, and embeddings).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

struct Layout {
  const uint8_t* codes;
  int64_t row_bytes, N, K, G;
  const at::Tensor* scales;
  const at::Tensor* mins;  // nullptr: none
  const float* book;       // 4-bit only
  int bits;
};

Layout make_layout(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                   const std::optional<at::Tensor>& codebook, int64_t bits, int64_t G) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && q.element_size() == 1,
              "quantized weights: codes must be [N, bytes] uint8/int8 with contiguous rows");
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (bits == 8 ? G % 16 == 0 : (G == 16 || G % 32 == 0)),
              "quantized weights: group size must divide K (a multiple of 16; 4-bit: 16 or 32k)");
  auto check_groups = [&](const at::Tensor& s, const char* name) {
    TORCH_CHECK((s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat) && s.dim() == 2 && s.size(0) == N &&
                    s.size(1) == K / G && s.stride(1) == 1,
                "quantized weights: ", name, " must be float16 or float32 [N, K / group_size]");
  };
  check_groups(scales, "scales");
  if (mins) check_groups(*mins, "mins");
  TORCH_CHECK(bits == 8 || (codebook && codebook->scalar_type() == at::kFloat && codebook->is_contiguous() &&
                            codebook->numel() == 16),
              "quantized weights: 4-bit codes need a contiguous float32 codebook of 16 values");
  return Layout{static_cast<const uint8_t*>(q.data_ptr()), q.stride(0), N, K, G, &scales,
                mins ? &*mins : nullptr, bits == 4 ? codebook->const_data_ptr<float>() : nullptr,
                static_cast<int>(bits)};
}

inline float group_value(const at::Tensor& t, int64_t n, int64_t g) {
  if (t.scalar_type() == at::kHalf) return static_cast<float>(t.const_data_ptr<c10::Half>()[n * t.stride(0) + g]);
  return t.const_data_ptr<float>()[n * t.stride(0) + g];
}

// Weight row n as float32 into w[K]: scale * value (exact) + min, one rounding.
void decode_row(const Layout& l, int64_t n, float* w) {
  const uint8_t* row = l.codes + n * l.row_bytes;
  if (l.bits == 8) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(row);
    for (int64_t g = 0; g < l.K / l.G; ++g) {
      const float s = group_value(*l.scales, n, g), m = l.mins ? group_value(*l.mins, n, g) : 0.0f;
      for (int64_t k = g * l.G; k < (g + 1) * l.G; ++k) w[k] = s * static_cast<float>(codes[k]) + m;
    }
    return;
  }
  // 4-bit: the run of 32 inputs k0.. holds k0 + j in byte j's low nibble, k0 + 16 + j in its high;
  // each half of a run lies in one group (groups are 16 or a multiple of 32 inputs).
  for (int64_t k0 = 0; k0 < l.K; k0 += 32) {
    const uint8_t* bytes = row + k0 / 2;
    const int64_t g_lo = k0 / l.G, g_hi = (k0 + 16) / l.G;
    const float s_lo = group_value(*l.scales, n, g_lo), s_hi = group_value(*l.scales, n, g_hi);
    const float m_lo = l.mins ? group_value(*l.mins, n, g_lo) : 0.0f;
    const float m_hi = l.mins ? group_value(*l.mins, n, g_hi) : 0.0f;
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

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

void quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                  int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const Layout l = make_layout(qweight, scales, mins, codebook, bits, group_size);
  const int64_t M = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == l.K, "quant_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_linear: float32 or bfloat16 x");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == l.N && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "quant_linear: out must be [M, N] of x's dtype with contiguous rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == l.N),
              "quant_linear: bias must be contiguous float32 [N]");
  const at::Tensor x32 = (x.scalar_type() == at::kFloat ? x : x.to(at::kFloat)).contiguous();
  const float* xp = x32.const_data_ptr<float>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  auto run = [&](auto* op) {
    const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(l.K, 1));
    at::parallel_for(0, l.N, grain, [&](int64_t n0, int64_t n1) {
      std::vector<float> w(l.K);
      for (int64_t n = n0; n < n1; ++n) {
        decode_row(l, n, w.data());
        for (int64_t r = 0; r < M; ++r)
          store(op + r * out.stride(0) + n, dot(xp + r * l.K, w.data(), l.K) + (bp ? bp[n] : 0.0f));
      }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
