// Random sampling of plain rows (a temperature, no top-k, top-p or min-p) in one pass over their
// logits and a second over one block: what pagedllm/worker/sampler.py's inverse CDF does with torch ops
// (scale, max, exp, block sums, cumulative sums, two searches), without its five full-width
// temporaries. On 64 rows of a 49k vocabulary: ~5.6 ms of torch ops per step in the served core,
// the largest piece of a temperature-1 step after the model (docs/benchmarks.md, Serving).
//
// Row r: weights w = exp(l / T - max(l) / T) in fp32 (the likeliest weighs 1), summed per block of
// kBlock in fp32, the block sums cumulated in fp64; target = u * total (below the total); the block
// where the cumulative sum first passes it, then, inside it, the first token whose cumulative
// weight (fp64, rescaled to the block's share) passes the remainder: never a zero weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace pagedllm_vec;

constexpr int64_t kBlock = 256;  // as sampler.CDF_BLOCK

// max over n fp32 values
float row_max(const float* l, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(l + i));
  if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), l + i));
  return _mm512_reduce_max_ps(m);
}

// w[i] = exp(l[i] / t - top) for 16 values (masked lanes 0)
inline __m512 weights16(const float* l, __mmask16 m, __m512 t, __m512 top) {
  const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, l);
  return _mm512_maskz_mov_ps(m, exp_f32(_mm512_sub_ps(_mm512_div_ps(x, t), top)));
}

int64_t sample_row(const float* l, int64_t n, float temperature, double u, std::vector<double>& cdf) {
  const __m512 t = _mm512_set1_ps(temperature);
  const __m512 top = _mm512_set1_ps(row_max(l, n) / temperature);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  cdf.resize(blocks);
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); i += 16)
      sum = _mm512_add_ps(sum, weights16(l + i, tail_mask(n - i), t, top));
    running += static_cast<double>(_mm512_reduce_add_ps(sum));
    cdf[b] = running;
  }
  const double total = cdf[blocks - 1];
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  const int64_t block = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
  const double before = block > 0 ? cdf[block - 1] : 0.0;
  const int64_t begin = block * kBlock, end = std::min(n, begin + kBlock);
  alignas(64) float w[kBlock];
  for (int64_t i = begin; i < end; i += 16)
    _mm512_store_ps(w + (i - begin), weights16(l + i, tail_mask(end - i), t, top));
  double within = 0.0;
  for (int64_t i = 0; i < end - begin; ++i) within += w[i];
  // The block's share of the cumulative sums and its own sum in fp64 may differ by an ulp: the
  // remainder is rescaled to the latter, below it.
  const double share = cdf[block] - before;
  const double remainder = std::max(0.0, (target - before) / share * within);
  double cumulative = 0.0;
  int64_t last_nonzero = begin;
  for (int64_t i = 0; i < end - begin; ++i) {
    if (w[i] <= 0.0f) continue;
    cumulative += w[i];
    last_nonzero = begin + i;
    if (cumulative > remainder) return begin + i;
  }
  return last_nonzero;
}

// tokens [R] for rows `rows` of logits (fp32 [N, V], contiguous rows), each at its temperature
// from its uniform number in [0, 1).
at::Tensor sample_plain(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperatures,
                        const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "sample_plain: logits must be float32 [N, V] with contiguous rows");
  const int64_t R = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && temperatures.scalar_type() == at::kFloat &&
                  uniforms.scalar_type() == at::kDouble && temperatures.numel() == R && uniforms.numel() == R &&
                  rows.is_contiguous() && temperatures.is_contiguous() && uniforms.is_contiguous(),
              "sample_plain: rows int64, temperatures float32 and uniforms float64, one each per row");
  TORCH_CHECK(V > 0, "sample_plain: an empty vocabulary");
  at::Tensor out = at::empty({R}, rows.options());
  const float* lp = logits.const_data_ptr<float>();
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const float* tp = temperatures.const_data_ptr<float>();
  const double* up = uniforms.const_data_ptr<double>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < logits.size(0) && tp[r] > 0.0f, "sample_plain: bad row or temperature");
  }
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> cdf;
    for (int64_t r = r0; r < r1; ++r) op[r] = sample_row(lp + rp[r] * logits.stride(0), V, tp[r], up[r], cdf);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("sample_plain(Tensor logits, Tensor rows, Tensor temperatures, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("sample_plain", &sample_plain);
}
