// An embedding lookup in a quantized table in one call: the rows of ids gathered to the plain
// layout, then dequantized by the tier's quant_dequantize (so the values are that op's, bit for
// bit). The table comes plain ([N, row bytes] codes, [N, groups] scales) or row-interleaved for
// the int8 kernel (pagedllm/model/quant_weight.py: codes [N / 16, K / 32, 16 x 32 or 16 x 16
// bytes], each block's bytes 4 at a time from the 16 rows in turn; scales [N / 16, groups, 16]).
// Python's gather of one row from the interleaved layout took some ten torch calls, a good part of
// a one-stream decode step's embedding time once the weights' stream has pushed them out of cache.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"

namespace {

constexpr int64_t kInterleavedRows = 16;  // quant_weight.INTERLEAVED_ROWS

// Plain rows of a table: `rows` [ids, per row] from `table`, whose row `id` is found by `locate`.
template <typename Locate>
at::Tensor gather(const at::Tensor& table, const int64_t* ids, int64_t n, int64_t per_row, Locate&& locate) {
  at::Tensor rows = at::empty({n, per_row}, table.options());
  const size_t size = table.element_size();
  char* dst = static_cast<char*>(rows.mutable_data_ptr());
  for (int64_t i = 0; i < n; ++i) locate(ids[i], dst + i * per_row * size);
  return rows;
}

// Row `id` of a plain table [N, per_row], copied to dst.
void copy_plain(const at::Tensor& table, int64_t id, char* dst) {
  const size_t bytes = table.size(1) * table.element_size();
  std::memcpy(dst, static_cast<const char*>(table.const_data_ptr()) + id * bytes, bytes);
}

// Row `id` of interleaved codes [groups, blocks, width]: per block, width / 16 bytes, 4 at a time.
void copy_interleaved_codes(const at::Tensor& codes, int64_t id, char* dst) {
  const int64_t blocks = codes.size(1), width = codes.size(2), chunks = width / (4 * kInterleavedRows);
  const char* src = static_cast<const char*>(codes.const_data_ptr()) + (id / kInterleavedRows) * blocks * width +
                    (id % kInterleavedRows) * 4;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t c = 0; c < chunks; ++c) std::memcpy(dst + (b * chunks + c) * 4, src + b * width + c * 4 * kInterleavedRows, 4);
}

// Row `id` of interleaved scales or mins [groups, row groups, 16].
void copy_interleaved_scales(const at::Tensor& scales, int64_t id, char* dst) {
  const int64_t per_row = scales.size(1);
  const size_t size = scales.element_size();
  const char* src = static_cast<const char*>(scales.const_data_ptr()) +
                    ((id / kInterleavedRows) * per_row * kInterleavedRows + id % kInterleavedRows) * size;
  for (int64_t j = 0; j < per_row; ++j) std::memcpy(dst + j * size, src + j * kInterleavedRows * size, size);
}

}  // namespace

namespace pagedllm_ops {

at::Tensor quant_embedding(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           const std::optional<at::Tensor>& codebook, int64_t bits, int64_t group_size,
                           const at::Tensor& ids, at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "quant_embedding: ids must be a contiguous int64 [n]");
  const bool interleaved = qweight.dim() == 3;
  TORCH_CHECK((interleaved || qweight.dim() == 2) && qweight.is_contiguous() && scales.is_contiguous() &&
                  scales.dim() == qweight.dim() && (!mins || (mins->is_contiguous() && mins->sizes() == scales.sizes())),
              "quant_embedding: contiguous codes [N, bytes] and scales [N, groups], or their row-interleaved "
              "layout [N / 16, K / 32, bytes] and [N / 16, groups, 16]");
  const int64_t num_rows = interleaved ? qweight.size(0) * kInterleavedRows : qweight.size(0);
  const int64_t n = ids.size(0);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_rows, "quant_embedding: id ", id[i], " outside the table's ", num_rows, " rows");
  if (!interleaved) {
    auto plain = [&](const at::Tensor& t) {
      return gather(t, id, n, t.size(1), [&](int64_t row, char* dst) { copy_plain(t, row, dst); });
    };
    return quant_dequantize(plain(qweight), plain(scales), mins ? std::optional<at::Tensor>(plain(*mins)) : std::nullopt,
                            codebook, bits, group_size, dtype);
  }
  const int64_t row_bytes = qweight.size(1) * qweight.size(2) / kInterleavedRows;
  const at::Tensor codes =
      gather(qweight, id, n, row_bytes, [&](int64_t row, char* dst) { copy_interleaved_codes(qweight, row, dst); });
  auto by_row = [&](const at::Tensor& t) {
    return gather(t, id, n, t.size(1), [&](int64_t row, char* dst) { copy_interleaved_scales(t, row, dst); });
  };
  return quant_dequantize(codes, by_row(scales), mins ? std::optional<at::Tensor>(by_row(*mins)) : std::nullopt,
                          codebook, bits, group_size, dtype);
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_embedding(Tensor qweight, Tensor scales, Tensor? mins, Tensor? codebook, int bits, int group_size, "
        "Tensor ids, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("quant_embedding", &pagedllm_ops::quant_embedding); }
