"""The model runner on its own: its persistent block table, the flat batch it builds from a
scheduler output (compared with a hand computation), block copies, and which logits it returns.
A stand-in model records its inputs, so nothing here depends on a real model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.worker.runner import ModelRunner

BLOCK_SIZE = 4


class RecordingModel(torch.nn.Module):
    """Hidden state of a token = its input id; logits = that id spread over a vocab of 100."""

    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=2, kv_lora_rank=0,
                             attention_layers=(0, 1), is_hybrid=False)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.calls.append((input_ids.clone(), positions.clone(), meta))
        return input_ids.float().unsqueeze(1)

    def compute_logits(self, hidden):
        return hidden * torch.ones(1, 100)


def make_runner(max_model_len: int = 32, num_blocks: int = 16):
    model = RecordingModel()
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                         max_model_len=max_model_len, kv_dtype=torch.float32)
    return runner, model


def scheduled(request_id: str, token_ids: list[int], num_computed: int, num_new: int,
              block_ids: list[int]) -> ScheduledRequest:
    request = SimpleNamespace(request_id=request_id, token_ids=token_ids, num_tokens=len(token_ids))
    return ScheduledRequest(request, num_new, num_computed, block_ids, BLOCK_SIZE)


# -- the flat batch --------------------------------------------------------------------------------

def test_a_mixed_batch_of_prefill_chunks_and_decodes_matches_a_hand_computation():
    runner, model = make_runner()
    batch = [
        scheduled("decode", [11, 12, 13, 14, 15, 16], 5, 1, [2, 6]),  # position 5: block 6, slot 1
        scheduled("chunk", list(range(20, 30)), 4, 5, [9, 1, 4]),  # positions 4..8
        scheduled("prompt", [40, 41, 42], 0, 3, [0]),  # positions 0..2
    ]
    input_ids, positions, meta, *_ = runner.prepare_inputs(batch)
    assert input_ids.tolist() == [16, 24, 25, 26, 27, 28, 40, 41, 42]
    assert positions.tolist() == [5, 4, 5, 6, 7, 8, 0, 1, 2]
    # slot = block id * 4 + position % 4, each through its own request's table
    assert meta.slot_mapping.tolist() == [6 * 4 + 1, 1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3,
                                          4 * 4 + 0, 0, 1, 2]
    # The table's first rows, read in place: every column, the longest request's blocks first.
    assert meta.block_tables[:, :3].tolist() == [[2, 6, 0], [9, 1, 4], [0, 0, 0]]
    assert meta.block_tables.data_ptr() == runner.block_table.table.ctypes.data
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [6, 9, 3]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 1, 6, 9]


def test_decodes_only_reuse_the_rows_and_follow_new_blocks():
    runner, _ = make_runner()
    tokens = [1, 2, 3, 4]
    blocks = [5]
    first = [scheduled("a", tokens, 0, 4, blocks)]
    runner.prepare_inputs(first)
    tokens.append(9)
    blocks.append(3)  # the fifth token starts a new block
    _, positions, meta, *_ = runner.prepare_inputs([scheduled("a", tokens, 4, 1, blocks)])
    assert positions.tolist() == [4] and meta.slot_mapping.tolist() == [3 * 4]
    assert meta.block_tables[:, :2].tolist() == [[5, 3]]


def test_block_copies_are_done_in_every_layer_at_once():
    runner, _ = make_runner(num_blocks=6)
    for key_cache, value_cache in runner.kv_caches:
        for block in range(6):
            key_cache[block] = block
            value_cache[block] = -block
    runner.copy_blocks([(1, 4), (2, 5)])
    for key_cache, value_cache in runner.kv_caches:
        assert [int(key_cache[b].flatten()[0]) for b in range(6)] == [0, 1, 2, 3, 1, 2]
        assert [int(value_cache[b].flatten()[0]) for b in range(6)] == [0, -1, -2, -3, -1, -2]


def test_execute_returns_the_logits_of_requests_that_reached_their_last_token():
    runner, model = make_runner()
    batch = [
        scheduled("chunk", list(range(20, 30)), 0, 4, [1, 2, 3]),  # 6 tokens still to go
        scheduled("decode", [7, 8, 9], 2, 1, [0]),
        scheduled("prompt", [40, 41, 42], 0, 3, [4]),
    ]
    logits, sample_idx, _ = runner.execute(batch)
    assert sample_idx == [1, 2]
    assert logits[:, 0].tolist() == [9.0, 42.0]  # each one's last new token
    runner.drop_requests([SimpleNamespace(request_id="chunk")])
    assert runner.block_table.row_of("prompt") == 0  # the last row took chunk's place
    assert runner.block_table.sync("next", [8]) == 2


def test_a_step_that_skips_a_live_request_runs_in_row_order_and_maps_its_logits_back():
    runner, model = make_runner()
    a = scheduled("a", [1, 2, 3], 0, 3, [0])
    b = scheduled("b", [4, 5, 6], 0, 3, [1])
    c = scheduled("c", [7, 8, 9], 0, 3, [2])
    runner.execute([a, b, c])  # rows a 0, b 1, c 2
    for item, token in ((a, 11), (c, 13)):
        item.request.token_ids.append(token)
    # b skips this step; c, scheduled first, sits below it.
    logits, sample_idx, _ = runner.execute([scheduled("c", c.request.token_ids, 3, 1, [2]),
                                            scheduled("a", a.request.token_ids, 3, 1, [0])])
    input_ids, _, meta = model.calls[-1]
    assert input_ids.tolist() == [11, 13]  # row order: a, then c moved up into row 1
    assert meta.block_tables[:, 0].tolist() == [0, 2]
    assert sample_idx == [1, 0] and logits[:, 0].tolist() == [11.0, 13.0]
    assert runner.block_table.row_of("b") == 2


def test_blocks_are_touched_once_when_a_step_first_writes_them(monkeypatch):
    from pagedllm.kernels.attention import cpu_attention

    touched: list[list[int]] = []
    monkeypatch.setattr(cpu_attention, "touch_blocks", lambda caches, ids: touched.append(ids.tolist()))
    runner, _ = make_runner()
    if runner.touched_blocks is None:
        pytest.skip("no compiled CPU kernels here: blocks are faulted in as they are written")
    runner.prepare_inputs([scheduled("a", list(range(6)), 0, 6, [3, 9]),  # slots 12..15, 36..37
                           scheduled("b", [1, 2], 0, 2, [5])])
    runner.prepare_inputs([scheduled("a", list(range(7)), 6, 1, [3, 9]),  # block 9 again: not new
                           scheduled("c", [4] * 5, 4, 1, [9, 1])])  # position 4: block 1
    assert touched == [[3, 5, 9], [1]]
