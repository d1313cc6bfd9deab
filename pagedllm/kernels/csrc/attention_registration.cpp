// The attention kernels' torch ops (namespace pagedllm_<tier>: compiled.py builds one per tier).

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "ops.h"

using namespace pagedllm_attention;

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("attention_amx_available", &attention_amx_available);
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale, "
        "Tensor? value_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, float softcap, bool use_amx) -> Tensor");
  m.def("paged_attention_invariant(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale, "
        "Tensor? value_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, float softcap) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor(c!)? key_scale, "
        "Tensor(d!)? value_scale, Tensor slot_mapping) -> ()");
  m.def("touch_blocks(Tensor[] caches, Tensor block_ids) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_invariant", &paged_attention_invariant);
  m.impl("write_kv", &write_kv);
  m.impl("touch_blocks", &touch_blocks);
}
