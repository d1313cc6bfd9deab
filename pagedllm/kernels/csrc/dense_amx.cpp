// out = x @ W^T (+ bias) for bf16 activations and bf16 weights on AMX tiles, every row count from a
// decode step's few rows to a prefill chunk's thousands. Written for the decode case, where the
// step streams every weight from memory once: the weight is packed once, at load, into panels of 32
// output features whose bytes lie in the order the tile loads read them, so each thread streams
// its share of the panels front to back; x is read in place (tile rows at its row stride), and
// each accumulator row goes to out as it is (no transposes). oneDNN's packed kernel, which this
// replaces where AMX is present, streamed the weights at 11-16 GB/s on two cores where this
// reaches 14-21 (docs/benchmarks.md, CPU speed).
//
// Packed layout: panel p holds output features [32 p, 32 p + 32) (zeros past N) as two feature
// tiles (+0..15, +16..31), each the K / 32 B tiles of its runs of 32 inputs end to end: a tile is
// 16 input pairs x 16 features, each element a pair (w[n][k], w[n][k + 1]) as the tile unit's dot
// products take them (1 KiB). So a panel streams from memory as two sequential runs, which came in
// 8-10% faster at 16 rows than one run with the tiles interleaved. The same bytes as the weight
// (plus the padding of the last panel).
//
// Sums: each output is accumulated in fp32 over K in the same order whatever the number of rows,
// so a row's result does not depend on the rows beside it; rounded to bf16 once, bias included.
//
// Stores: a block's accumulators (32 rows x one panel) are rounded into out while the tile unit
// multiplies the next block, a few rows between its tile products (Pipelined), so the vector
// work (rounding, bias, SiLU) overlaps the products instead of following them: a 4,096-row
// prefill's gated gate/up 6.5 -> 5.4 ms, 64-row decode matmuls 14.0-14.5 -> 12.8-13.3 ms for 30
// layers. Threads split a decode's panels (each streams its share of the weight once) and a
// prefill's rows (each its own outputs; splitting panels there was 10-20% slower).
//
// Argmax (an LM head under greedy sampling): the logits are never stored; each row keeps, lane by
// lane, the largest bf16-rounded logit seen and its first index, so the result is
// round(x @ W^T).float().max(-1).indices, the first of equal maxima (NaN logits are never chosen).
//
// Gated (a fused gate/up projection [gate | up] of I features each, SwiGLU): panel p's first tile
// holds gate features [16 p, 16 p + 16), its second the matching up features, and the store writes
// round(round(silu(gate)) * up) from the two rounded halves, as the separate silu_and_mul
// (fused_ops.cpp) would from the stored gate_up: out [M, I], and the 2 I-wide intermediate never
// goes to memory.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace {

using BF16 = c10::BFloat16;
constexpr int64_t kPanel = 32;       // output features per panel
constexpr int64_t kRun = 32;         // inputs per run (one A tile's width)

bool dense_amx_available() { return pagedllm_amx::amx_ready(); }

// Panels of a weight with N rows (outputs), or of a gated one with N = 2 I rows (I outputs).
int64_t num_panels(int64_t N, bool gated) { return gated ? (N / 2 + 15) / 16 : (N + kPanel - 1) / kPanel; }

// The weight row that feature f (0..31) of panel p comes from, or -1 (padding).
int64_t source_row(int64_t p, int64_t f, int64_t N, bool gated) {
  if (!gated) return p * kPanel + f < N ? p * kPanel + f : -1;
  const int64_t I = N / 2, i = p * 16 + f % 16;
  return i < I ? (f < 16 ? i : I + i) : -1;
}

// Where, within a panel, the B tile of run `run` and feature tile f starts: each feature tile's
// runs lie end to end (K / 32 tiles of 512 bf16), the second feature tile's after the first's.
inline int64_t weight_tile(int64_t K, int64_t run, int64_t f) { return (f * (K / kRun) + run) * 512; }

at::Tensor dense_amx_pack(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "dense_amx_pack: the weight must be bfloat16 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), panels = num_panels(N, gated);
  TORCH_CHECK(K % kRun == 0, "dense_amx_pack: K must be a multiple of 32, got ", K);
  TORCH_CHECK(!gated || N % 2 == 0, "dense_amx_pack: a gated weight has an even number of rows");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({panels * kPanel * K}, weight.options());
  const BF16* src = w.const_data_ptr<BF16>();
  BF16* dst = packed.mutable_data_ptr<BF16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t run = 0; run < K / kRun; ++run) {
        for (int64_t f = 0; f < kPanel; ++f) {  // feature f of the panel: tile f / 16, column f % 16
          const int64_t n = source_row(p, f, N, gated);
          BF16* col = dst + p * kPanel * K + weight_tile(K, run, f / 16) + (f % 16) * 2;
          for (int64_t pair = 0; pair < kRun / 2; ++pair) {
            col[pair * 32] = n >= 0 ? src[n * K + run * kRun + 2 * pair] : BF16(0.0f);
            col[pair * 32 + 1] = n >= 0 ? src[n * K + run * kRun + 2 * pair + 1] : BF16(0.0f);
          }
        }
      }
    }
  });
  return packed;
}

#ifdef PAGEDLLM_AMX

using pagedllm_vec::exp_f32;
using pagedllm_vec::tail_mask;

inline __m512 round_bf16(__m512 v) {  // v rounded to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// x's rows [M, K] as the tile loads read them: whole tiles of `multiple` rows. Where M is not a
// multiple of it, a copy followed by rows of zeros; otherwise x in place.
struct PaddedRows {
  std::unique_ptr<BF16[]> copy;
  const BF16* data;
  int64_t stride, rows;
  PaddedRows(const at::Tensor& x, int64_t multiple)
      : data(x.const_data_ptr<BF16>()), stride(x.stride(0)), rows((x.size(0) + multiple - 1) / multiple * multiple) {
    const int64_t M = x.size(0), K = x.size(1);
    if (rows == M) return;
    copy.reset(new BF16[rows * K]);
    for (int64_t m = 0; m < M; ++m) std::memcpy(copy.get() + m * K, data + m * stride, K * sizeof(BF16));
    std::memset(static_cast<void*>(copy.get() + M * K), 0, (rows - M) * K * sizeof(BF16));
    data = copy.get();
    stride = K;
  }
};

// A finished block's accumulators, handed to `Rows` (rounded into out, or compared for an argmax)
// a few rows at a time while the tile unit multiplies the next block (multiply_panel calls
// rows_until between its tile products): the vector unit's rounding, bias and SiLU then overlap
// the tile products instead of following them. Tiles of two blocks in turn: the pending one, and
// the one being multiplied.
template <class Rows>
class Pipelined {
 public:
  explicit Pipelined(Rows rows) : work_(std::move(rows)) {}

  // Where the block to multiply next accumulates (the other buffer than the pending block's).
  float (*next_tiles())[256] { return tiles_[1 - pending_]; }

  // The block just multiplied into next_tiles() becomes the pending one (rows [0, rows);
  // Rows::begin_block takes the rest), after the one before it is finished.
  template <class... Block>
  void push(int64_t rows, const Block&... block) {
    finish();
    pending_ = 1 - pending_;
    rows_ = rows, done_ = 0;
    work_.begin_block(block...);
  }

  void rows_until(int64_t end) {
    for (end = std::min(end, rows_); done_ < end; ++done_) work_.row(tiles_[pending_], done_);
  }
  void finish() { rows_until(rows_); }
  int64_t rows() const { return rows_; }

 private:
  alignas(64) float tiles_[2][4][256];
  Rows work_;
  int pending_ = 0;
  int64_t rows_ = 0, done_ = 0;
};

// A block's row m rounded into out: its 32 outputs (bias included), or gated its 16
// round(round(silu(gate)) * up), gate and up each rounded first, as silu_and_mul would.
template <bool kGated>
struct StoreRows {
  BF16* out = nullptr;
  int64_t ldo = 0, column[2] = {};
  __m512 bias[2];
  __mmask16 cols[2] = {};

  // Panel p of a weight of N rows into out (row stride ldo), from row 0 of the block.
  void begin_block(int64_t p, int64_t N, const float* b, BF16* o, int64_t ld) {
    out = o, ldo = ld;
    for (int f = 0; f < 2; ++f) {  // gated: f = 0 the gate, 1 the up half, both for outputs 16 p ..
      const int64_t n0 = kGated ? f * (N / 2) + 16 * p : kPanel * p + 16 * f;
      const int64_t limit = kGated ? (f + 1) * (N / 2) : N;
      cols[f] = n0 < limit ? tail_mask(limit - n0) : 0;
      bias[f] = b ? _mm512_maskz_loadu_ps(cols[f], b + n0) : _mm512_setzero_ps();
      column[f] = kGated ? 16 * p : n0;
    }
  }

  void row(float (*tiles)[256], int64_t m) const {
    const float* first = tiles[2 * (m / 16)] + (m % 16) * 16;  // feature tile 0's row; tile 1's is 256 on
    BF16* dst = out + m * ldo;
    if (kGated) {
      const __m512 g = round_bf16(_mm512_add_ps(_mm512_loadu_ps(first), bias[0]));
      const __m512 u = round_bf16(_mm512_add_ps(_mm512_loadu_ps(first + 256), bias[1]));
      const __m512 e = exp_f32(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      _mm256_mask_storeu_epi16(dst + column[0], cols[0], (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
      return;
    }
    for (int f = 0; f < 2; ++f) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(first + 256 * f), bias[f]);
      _mm256_mask_storeu_epi16(dst + column[f], cols[f], (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
};

// The fp32 products of x rows a (stride lda, 16 kRowTiles rows readable) with one panel over K,
// into tiles[2 r + f] (row tile r, feature tile f). Tile registers 0-3: accumulators, 4-5: x,
// 6-7: the weight. Between its products it hands `pending` the rows of the block before, spread
// over the K / 32 steps.
template <int kRowTiles, class Pending>
void multiply_panel(const BF16* panel, int64_t K, const BF16* a, int64_t lda, float (*tiles)[256],
                    Pending& pending) {
  _tile_zero(0);
  _tile_zero(1);
  if (kRowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t steps = K / kRun, rows_per_step = (pending.rows() + steps - 1) / steps;
  for (int64_t k = 0; k < K; k += kRun) {
    _tile_loadd(6, panel + weight_tile(K, k / kRun, 0), 64);
    _tile_loadd(7, panel + weight_tile(K, k / kRun, 1), 64);
    _tile_loadd(4, a + k, lda * sizeof(BF16));
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kRowTiles == 2) {
      _tile_loadd(5, a + 16 * lda + k, lda * sizeof(BF16));
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.rows_until((k / kRun + 1) * rows_per_step);
  }
  _tile_stored(0, tiles[0], 64);  // tile numbers are immediates: no loop
  _tile_stored(1, tiles[1], 64);
  if (kRowTiles == 2) {
    _tile_stored(2, tiles[2], 64);
    _tile_stored(3, tiles[3], 64);
  }
}

// out rows [0, rows) (rows <= 16 kRowTiles) x panel p's outputs (32, or 16 gated), from x rows a
// (stride lda, at least 16 kRowTiles rows readable), stored while the next block multiplies (or
// at pending.finish()). N: the weight's rows.
template <int kRowTiles, bool kGated>
void multiply_block(const BF16* panel, int64_t K, const BF16* a, int64_t lda, int64_t rows, int64_t p, int64_t N,
                    const float* bias, BF16* out, int64_t ldo, Pipelined<StoreRows<kGated>>& pending) {
  multiply_panel<kRowTiles>(panel, K, a, lda, pending.next_tiles(), pending);
  pending.push(rows, p, N, bias, out, ldo);
}

// Panels a thread takes in one pass over the rows of x: their weights stay in cache while every
// 32-row block of x goes by. Few rows: one panel (from DRAM for the first block, from L1 for the
// second); many rows: about 1 MiB of panels in L2, so x is read from L3 once per group.
inline int64_t panels_per_group(int64_t M, int64_t K) {
  const int64_t bytes = M <= 128 ? 64 * 1024 : 1024 * 1024;
  return std::max<int64_t>(1, bytes / (kPanel * K * static_cast<int64_t>(sizeof(BF16))));
}

template <bool kGated>
void multiply_panels(const BF16* wp, int64_t K, const BF16* xp, int64_t ldx, int64_t M, int64_t rows, int64_t N,
                     const float* bp, BF16* op, int64_t ldo) {
  const int64_t panels = num_panels(N, kGated), group = panels_per_group(M, K);
  // A thread's share: panels p0..p1 over rows m_begin..m_end (32-row blocks).
  auto run = [&](int64_t p0, int64_t p1, int64_t m_begin, int64_t m_end) {
    Pipelined<StoreRows<kGated>> pending{StoreRows<kGated>()};
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
        const int64_t block_rows = std::min<int64_t>(32, M - m0);
        for (int64_t p = g0; p < g1; ++p) {
          const BF16* panel = wp + p * kPanel * K;
          if (rows - m0 >= 32) {
            multiply_block<2, kGated>(panel, K, xp + m0 * ldx, ldx, block_rows, p, N, bp, op + m0 * ldo, ldo, pending);
          } else {
            multiply_block<1, kGated>(panel, K, xp + m0 * ldx, ldx, block_rows, p, N, bp, op + m0 * ldo, ldo, pending);
          }
        }
      }
    }
    pending.finish();
  };
  const int64_t blocks = (M + 31) / 32;
  if (blocks >= 8 * at::get_num_threads()) {
    // Many rows (a prefill chunk): each thread takes whole 32-row blocks over every panel, so
    // its outputs and its share of x are its own (panels split across threads came in 10-20%
    // slower from 1,024 rows up; fewer blocks than this would leave threads idle at the end).
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      pagedllm_amx::configure_tiles();
      run(0, panels, 32 * b0, std::min(M, 32 * b1));
      _tile_release();
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    pagedllm_amx::configure_tiles();
    run(p0, p1, 0, M);
    _tile_release();
  });
}

// Per row, lane by lane: the largest rounded logit seen so far and its index (strictly larger
// replaces, so of equal values the first seen stays: panels go by in ascending order).
struct RowMaxima {
  std::unique_ptr<float[]> value;    // [M][16]
  std::unique_ptr<int32_t[]> index;  // [M][16]
  explicit RowMaxima(int64_t M) : value(new float[M * 16]), index(new int32_t[M * 16]) {
    std::fill(value.get(), value.get() + M * 16, -INFINITY);
    std::fill(index.get(), index.get() + M * 16, 0);
  }
  // Row m's 16 rounded logits (bias b added) of features ids (cols of them real).
  void update_row(const float* logits, int64_t m, __m512 b, __mmask16 cols, __m512i ids) {
    float* best = value.get() + m * 16;
    int32_t* at = index.get() + m * 16;
    const __m512 v = round_bf16(_mm512_add_ps(_mm512_loadu_ps(logits), b));
    const __mmask16 larger = cols & _mm512_cmp_ps_mask(v, _mm512_loadu_ps(best), _CMP_GT_OQ);
    _mm512_mask_storeu_ps(best, larger, v);
    _mm512_mask_storeu_epi32(at, larger, ids);
  }
};

// The index of a row's largest value over its 16 lanes (one at least larger than -inf): the
// smallest index among the lanes holding it.
inline int64_t row_argmax(const float* value, const int32_t* index) {
  const float best = *std::max_element(value, value + 16);
  int64_t at = INT64_MAX;
  for (int l = 0; l < 16; ++l) {
    if (value[l] == best) at = std::min<int64_t>(at, index[l]);
  }
  return at;
}

// A block's row m compared into a thread's maxima (the block's rows start at m0).
struct ArgmaxRows {
  RowMaxima* maxima;
  int64_t m0 = 0;
  __m512 bias[2];
  __mmask16 cols[2] = {};
  __m512i ids[2];

  void begin_block(int64_t p, int64_t N, const float* b, int64_t first_row) {
    m0 = first_row;
    for (int f = 0; f < 2; ++f) {
      const int64_t n0 = kPanel * p + 16 * f;
      cols[f] = n0 < N ? tail_mask(N - n0) : 0;
      bias[f] = b ? _mm512_maskz_loadu_ps(cols[f], b + n0) : _mm512_setzero_ps();
      ids[f] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(n0)),
                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    }
  }

  void row(float (*tiles)[256], int64_t m) const {
    for (int f = 0; f < 2 && cols[f]; ++f)
      maxima->update_row(tiles[2 * (m / 16) + f] + (m % 16) * 16, m0 + m, bias[f], cols[f], ids[f]);
  }
};

#endif  // PAGEDLLM_AMX

// out = x @ W^T (+ bias) from dense_amx_pack(W, gated); gated: out [M, I] = SwiGLU of the gate and up halves.
void dense_amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      at::Tensor& out, bool gated) {
  TORCH_CHECK(dense_amx_available(), "dense_amx_linear: AMX-BF16 is not available here");
#ifdef PAGEDLLM_AMX
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "dense_amx_linear: x must be bfloat16 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = (gated ? 2 : 1) * out.size(1);
  const int64_t panels = num_panels(N, gated);
  TORCH_CHECK(K % kRun == 0 && packed.numel() == panels * kPanel * K && packed.scalar_type() == at::kBFloat16,
              "dense_amx_linear: the packed weight does not match x [M, K] and out [M, N]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && out.scalar_type() == at::kBFloat16,
              "dense_amx_linear: out must be bfloat16 [M, N] with contiguous rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "dense_amx_linear: bias must be contiguous float32 [N] (2 I gated)");
  if (M == 0) return;
  const PaddedRows xr(x, 16);
  const BF16* xp = xr.data;
  const int64_t ldx = xr.stride, rows = xr.rows;
  const BF16* wp = packed.const_data_ptr<BF16>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  BF16* op = out.mutable_data_ptr<BF16>();
  if (gated) {
    multiply_panels<true>(wp, K, xp, ldx, M, rows, N, bp, op, out.stride(0));
  } else {
    multiply_panels<false>(wp, K, xp, ldx, M, rows, N, bp, op, out.stride(0));
  }
#endif
}

// The same into a new tensor [M, N] (N the outputs: I when gated): one call from Python.
at::Tensor dense_amx_mm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t N, bool gated) {
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  dense_amx_linear(x, packed, bias, out, gated);
  return out;
}

// round(x @ W^T (+ bias)).float().max(-1).indices for an ungated dense_amx_pack(W) of N rows.
at::Tensor dense_amx_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t N) {
  TORCH_CHECK(dense_amx_available(), "dense_amx_argmax: AMX-BF16 is not available here");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "dense_amx_argmax: x must be bfloat16 [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), panels = num_panels(N, false);
  TORCH_CHECK(K % kRun == 0 && packed.numel() == panels * kPanel * K && packed.scalar_type() == at::kBFloat16,
              "dense_amx_argmax: the packed weight does not match x [M, K] and N");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "dense_amx_argmax: bias must be contiguous float32 [N]");
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
#ifdef PAGEDLLM_AMX
  if (M == 0) return out;
  const PaddedRows xr(x, 32);  // the argmax multiplies whole 32-row blocks
  const int64_t rows = xr.rows;
  const BF16* wp = packed.const_data_ptr<BF16>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t group = panels_per_group(M, K);
  // Each thread's share: a contiguous run of panels, kept apart so shares combine in vocabulary order.
  std::vector<std::pair<int64_t, std::unique_ptr<RowMaxima>>> shares(at::get_num_threads());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    pagedllm_amx::configure_tiles();
    auto maxima = std::make_unique<RowMaxima>(rows);
    Pipelined<ArgmaxRows> pending{ArgmaxRows{maxima.get()}};
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        for (int64_t p = g0; p < g1; ++p) {
          multiply_panel<2>(wp + p * kPanel * K, K, xr.data + m0 * xr.stride, xr.stride, pending.next_tiles(),
                            pending);
          pending.push(std::min<int64_t>(32, M - m0), p, N, bp, m0);
        }
      }
    }
    pending.finish();
    _tile_release();
    shares[at::get_thread_num()] = {p0, std::move(maxima)};
  });
  std::sort(shares.begin(), shares.end(), [](const auto& a, const auto& b) {
    return (a.second != nullptr) > (b.second != nullptr) || (a.second && b.second && a.first < b.first);
  });
  int64_t* op = out.mutable_data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    float best = -INFINITY;
    int64_t at = 0;
    for (const auto& [p0, maxima] : shares) {  // ascending panels: a later share wins only if larger
      if (!maxima) break;
      const float* value = maxima->value.get() + m * 16;
      const float share_best = *std::max_element(value, value + 16);
      if (share_best > best) best = share_best, at = row_argmax(value, maxima->index.get() + m * 16);
    }
    op[m] = at;
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("dense_amx_available", &dense_amx_available);
  m.def("dense_amx_pack(Tensor weight, bool gated) -> Tensor");
  m.def("dense_amx_mm(Tensor x, Tensor packed, Tensor? bias, int N, bool gated) -> Tensor");
  m.def("dense_amx_argmax(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("dense_amx_pack", &dense_amx_pack);
  m.impl("dense_amx_mm", &dense_amx_mm);
  m.impl("dense_amx_argmax", &dense_amx_argmax);
}
