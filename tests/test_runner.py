"""The model runner on its own: its persistent block table, the flat batch it builds from a
scheduler output (compared with a hand computation), block copies, and which logits it returns.
A stand-in model records its inputs, so nothing here depends on a real model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.runner import BlockTable, ModelRunner
from pagedllm.scheduler import ScheduledRequest

BLOCK_SIZE = 4


class RecordingModel(torch.nn.Module):
    """Hidden state of a token = its input id; logits = that id spread over a vocab of 100."""

    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=2)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.calls.append((input_ids.clone(), positions.clone(), meta))
        return input_ids.float().unsqueeze(1)

    def compute_logits(self, hidden):
        return hidden * torch.ones(1, 100)


def make_runner(max_num_seqs: int = 4, max_model_len: int = 32, num_blocks: int = 16):
    model = RecordingModel()
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=64, max_model_len=max_model_len, kv_dtype=torch.float32)
    return runner, model


def scheduled(request_id: str, token_ids: list[int], num_computed: int, num_new: int,
              block_ids: list[int]) -> ScheduledRequest:
    request = SimpleNamespace(request_id=request_id, token_ids=token_ids, num_tokens=len(token_ids))
    return ScheduledRequest(request, num_new, num_computed, block_ids, BLOCK_SIZE)


# -- the block table -----------------------------------------------------------------------------

def test_a_row_is_rewritten_from_its_last_synced_block_after_copy_on_write():
    table = BlockTable(num_rows=2, max_blocks_per_seq=4)
    blocks = [3, 5]
    row = table.sync("a", blocks)
    assert table.table[row, :2].tolist() == [3, 5]
    blocks[1] = 9  # copy-on-write gave the request its own copy of the block it writes into
    blocks.append(7)
    assert table.sync("a", blocks) == row
    assert table.table[row, :3].tolist() == [3, 9, 7]


def test_rows_are_reused_after_drop_and_grow_past_max_num_seqs():
    table = BlockTable(num_rows=2, max_blocks_per_seq=3)
    rows = {rid: table.sync(rid, [i, i + 10]) for i, rid in enumerate("abc")}  # a fork: 3 live
    assert sorted(rows.values()) == [0, 1, 2] and table.table.shape == (4, 3)
    for i, rid in enumerate("abc"):  # growing kept every row's contents
        assert table.table[rows[rid], :2].tolist() == [i, i + 10]
    table.drop("b")
    assert table.sync("d", [8]) == rows["b"]  # the freed row, rewritten from its start
    assert table.table[rows["b"], 0] == 8
    with pytest.raises(ValueError, match="needs 4 blocks"):
        table.sync("e", [1, 2, 3, 4])


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
    assert meta.block_tables.tolist() == [[2, 6, 0], [9, 1, 4], [0, 0, 0]]  # up to the longest
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
    assert meta.block_tables.tolist() == [[5, 3]]


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
    logits, sample_idx = runner.execute(batch)
    assert sample_idx == [1, 2]
    assert logits[:, 0].tolist() == [9.0, 42.0]  # each one's last new token
    runner.drop_requests([SimpleNamespace(request_id="chunk")])
    assert runner.block_table.sync("next", [8]) == 0  # chunk's row, free again
