// out = x @ W^T for bf16 activations and many rows (prefill chunks, decode batches) over weights
// kept quantized (quant_packed.h), with AMX tiles: each weight is dequantized to bf16 once per call
// (per 256 rows of x) and multiplied by the tile unit, 16 x 16 x 32 products per instruction. The
// dequantized bf16 weights are exactly what dequantizing the whole matrix to bf16 gives (as
// `--quantization none` would hold them), so this computes the dequantized bf16 matmul, summed in
// fp32.
//
// Roles: a weight tile is the A operand (16 output features x 32 inputs: 16 dequantized rows, as
// they are, read with a row stride) and x the B operand (32 inputs x 16 rows of x, in pairs of
// inputs: laid out once per call). A 2 x 2 block of fp32 accumulator tiles holds 32 output
// features x 32 rows of x, transposed on the way out.
//
// Built where the compiler and CPU have AMX-BF16; quant_amx_available() also asks the kernel for
// permission to use the tile registers (Linux's arch_prctl), once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include "amx.h"
#include "quant_packed.h"

namespace {
using namespace pagedllm_quant;

#ifdef PAGEDLLM_AMX
using pagedllm_amx::configure_tiles;

constexpr int kRowsPerChunk = 256;  // rows of x per pass over the weights: their B tiles stay in L2

// Scratch memory left uninitialized (every use writes it whole before reading it).
template <typename T>
std::unique_ptr<T[]> buffer(int64_t n) {
  return std::unique_ptr<T[]>(n ? new T[n] : nullptr);
}

// r[i] becomes column i of the 16 x 16 matrix of 32-bit values whose rows were r[0..15].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Each 128-bit lane j of r[4i + c] now holds row-group i's columns 4j + c... gather the lanes.
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
    }
  }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
  }
}

// x rows [m0, m0 + 16) (zeros past M) as a B operand: [K/2 input pairs][16 rows] of bf16 pairs.
void lay_out_block(const BF16* x, int64_t ldx, int64_t M, int64_t K, int64_t m0, uint32_t* out) {
  for (int64_t k = 0; k < K; k += 32) {
    __m512i r[16];
    for (int m = 0; m < 16; ++m) {
      r[m] = m0 + m < M ? _mm512_loadu_si512(x + (m0 + m) * ldx + k) : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (k / 2 + p) * 16, r[p]);
  }
}

template <typename T>
inline void store_row(T* out, __m512 v, __mmask16 m);
template <>
inline void store_row(float* out, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(out, m, v); }
template <>
inline void store_row(BF16* out, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// An accumulator tile (16 output features n0.. x 16 rows of x m0..) written to out[m][n] (+ bias).
template <typename T>
void write_tile(const float* tile, int64_t n0, int64_t m0, int64_t N, int64_t M, const float* bias, T* out, int64_t ldo) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tile + i * 16);
  transpose16(r);
  const __mmask16 cols = tail_mask(N - n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < 16 && m0 + m < M; ++m)
    store_row(out + (m0 + m) * ldo + n0, _mm512_add_ps(_mm512_castsi512_ps(r[m]), b), cols);
}

// Output features [32 p, 32 p + 32) dequantized to bf16 (zeros past N), a tile of 16 rows x 32
// inputs contiguous: run c of row i at c * 1024 + i * 32.
template <bool kU4, bool kMin, typename S>
void dequantize_panel(const Packed<S>& w, int64_t p, int64_t N, BF16* weights) {
  const int64_t K = w.K, n0 = 32 * p;
  for (int64_t i = 0; i < 32; ++i) {
    if (n0 + i < N) {
      dequantize_row<kU4, kMin>(w, n0 + i, weights + i * 32, 32 * 32);
    } else {
      for (int64_t c = 0; c < K / 32; ++c) std::memset(weights + c * 1024 + i * 32, 0, 32 * sizeof(BF16));
    }
  }
}

// out[m, 32 p .. 32 p + 32) for rows [m_begin, m_end) of x (their B blocks in xb), from a panel.
template <typename T>
void multiply_panel(const BF16* weights, int64_t K, int64_t p, const uint32_t* xb, int64_t m_begin, int64_t m_end,
                    int64_t N, int64_t M, const float* bias, T* out, int64_t ldo) {
  const int64_t n0 = 32 * p;
  alignas(64) float tiles[4][256];
  const int64_t block_pairs = K / 2 * 16;  // uint32 per B block of 16 rows
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
    const uint32_t* b0 = xb + (m0 - m_begin) / 16 * block_pairs;
    const uint32_t* b1 = b0 + block_pairs;  // the caller pads xb to an even number of blocks
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, weights + k * 32, 64);
      _tile_loadd(5, weights + k * 32 + 16 * 32, 64);
      _tile_loadd(6, b0 + k / 2 * 16, 64);
      _tile_loadd(7, b1 + k / 2 * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, tiles[0], 64);
    _tile_stored(1, tiles[1], 64);
    _tile_stored(2, tiles[2], 64);
    _tile_stored(3, tiles[3], 64);
    for (int a = 0; a < 2; ++a) {
      if (n0 + 16 * a >= N) break;
      write_tile(tiles[2 * a], n0 + 16 * a, m0, N, M, bias, out, ldo);
      if (m0 + 16 < M) write_tile(tiles[2 * a + 1], n0 + 16 * a, m0 + 16, N, M, bias, out, ldo);
    }
  }
}

#endif  // PAGEDLLM_AMX

bool quant_amx_available() { return pagedllm_amx::amx_ready(); }

void quant_linear_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& codebook, int64_t bits,
                      int64_t group_size, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(quant_amx_available(), "quant_linear_amx: AMX-BF16 is not available here");
#ifdef PAGEDLLM_AMX
  const Weights t{qweight, scales, mins, codebook, bits, group_size};
  const int64_t M = x.size(0), N = qweight.size(0);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "quant_linear_amx: x must be bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "quant_linear_amx: out must be [M, N] bfloat16 or float32 with contiguous rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "quant_linear_amx: bias must be contiguous float32 [N]");
  dispatch(t, [&](const auto& w, auto is_u4, auto with_min) {
    constexpr bool kU4 = decltype(is_u4)::value, kMin = decltype(with_min)::value;
    const int64_t K = w.K;
    TORCH_CHECK(K % 32 == 0 && x.size(1) == K, "quant_linear_amx: K must be a multiple of 32");
    const BF16* xp = x.const_data_ptr<BF16>();
    const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
    const int64_t panels = (N + 31) / 32;
    // Over kRowsPerChunk rows, the whole weight is dequantized once (a transient bf16 copy) rather
    // than once per chunk of rows.
    const bool dequantize_once = M > kRowsPerChunk;
    const auto all_panels = buffer<BF16>(dequantize_once ? panels * 32 * K : 0);
    if (dequantize_once) {
      at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) dequantize_panel<kU4, kMin>(w, p, N, all_panels.get() + p * 32 * K);
      });
    }
    auto run = [&](auto* op) {
      for (int64_t chunk = 0; chunk < M; chunk += kRowsPerChunk) {
        const int64_t rows = std::min<int64_t>(kRowsPerChunk, M - chunk), blocks = (rows + 31) / 32 * 2;
        const auto xb = buffer<uint32_t>(blocks * K / 2 * 16);
        at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) lay_out_block(xp, x.stride(0), M, K, chunk + 16 * b, xb.get() + b * K / 2 * 16);
        });
        at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
          configure_tiles();
          const auto own = buffer<BF16>(dequantize_once ? 0 : 32 * K);
          for (int64_t p = p0; p < p1; ++p) {
            const BF16* weights = dequantize_once ? all_panels.get() + p * 32 * K : own.get();
            if (!dequantize_once) dequantize_panel<kU4, kMin>(w, p, N, own.get());
            multiply_panel(weights, K, p, xb.get(), chunk, chunk + rows, N, M, bp, op, out.stride(0));
          }
          _tile_release();
        });
      }
    };
    if (out.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
    else run(out.mutable_data_ptr<BF16>());
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_amx_available", &quant_amx_available);
  m.def("quant_linear_amx(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, "
        "int group_size, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("quant_linear_amx", &quant_linear_amx);
}
