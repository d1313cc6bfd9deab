"""The runner's persistent block table: rows rewritten only where they changed, live requests in
the first rows (a dropped one's row takes the last), growth by doubling, holes mirrored, and a
record of every change that a device copy can follow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv.manager import NULL_BLOCK
from pagedllm.utils import cdiv
from pagedllm.worker.block_table import BlockTable
from pagedllm.worker.packet import pack_changes
from pagedllm.worker.upload import StepUpload


def test_a_row_is_rewritten_from_its_last_synced_block_after_copy_on_write():
    table = BlockTable(max_blocks_per_seq=4)
    blocks = [3, 5]
    row = table.sync("a", blocks)
    assert table.table[row, :2].tolist() == [3, 5]
    blocks[1] = 9  # copy-on-write gave the request its own copy of the block it writes into
    blocks.append(7)
    assert table.sync("a", blocks) == row
    assert table.table[row, :3].tolist() == [3, 9, 7]


def test_a_cut_row_is_rewritten_from_the_cut_when_its_list_grows_again():
    """A speculative step's rejected blocks went back (SchedulerOutput.trimmed), and before the
    next step another request took one of them and this one took others: the row must not keep
    the blocks it gave back."""
    table = BlockTable(max_blocks_per_seq=16)
    row = table.sync("a", [3, 5, 8, 9])
    table.cut("a", 2)
    assert table.sync("a", [3, 5, 12, 13, 14]) == row
    assert table.table[row, :5].tolist() == [3, 5, 12, 13, 14]
    table.cut("gone", 1)  # a request without a row (dropped since): nothing to do


def test_live_requests_keep_the_first_rows_and_the_table_grows_by_doubling():
    table = BlockTable(max_blocks_per_seq=200)
    assert table.table.shape == (8, 64)
    for i in range(9):  # a ninth live request doubles the rows
        assert table.sync(f"r{i}", [i, i + 100]) == i
    assert table.table.shape == (16, 64)
    grown = [3, 103] + list(range(63))
    table.sync("r3", grown)  # wider than the table: doubles the width
    assert table.table.shape == (16, 128) and table.table[3, :65].tolist() == grown
    assert all(table.table[i, :2].tolist() == [i, i + 100] for i in range(9) if i != 3)
    table.drop("r1")  # the last live row moves into row 1
    assert table.row_of("r8") == 1 and table.table[1, :2].tolist() == [8, 108]
    assert table.num_live == 8 and table.sync("new", [5]) == 8
    with pytest.raises(ValueError, match="needs 201 blocks"):
        table.sync("r0", list(range(201)))


def test_holes_the_manager_leaves_are_mirrored_once():
    table = BlockTable(max_blocks_per_seq=16, track_changes=True)
    blocks = [4, 5, 6]
    row = table.sync("a", blocks)
    table.take_changes()
    blocks[0] = NULL_BLOCK  # the window moved past block 0
    blocks.append(7)
    table.sync("a", blocks)
    assert table.table[row, :4].tolist() == [NULL_BLOCK, 5, 6, 7]
    assert sorted(table.take_changes()) == [(row, 0, 1), (row, 2, 4)]
    blocks.append(8)
    table.sync("a", blocks)
    assert table.take_changes() == [(row, 3, 5)]  # nothing new at the front: not scanned again


def test_place_first_swaps_the_step_requests_into_the_first_rows():
    table = BlockTable(max_blocks_per_seq=8)
    for i, rid in enumerate("abcd"):
        table.sync(rid, [i] * (i + 1))
    table.place_first(["a", "c"])  # b skips the step
    assert [table.row_of(r) for r in "acbd"] == [0, 1, 2, 3]
    assert table.table[1, :3].tolist() == [2, 2, 2] and table.table[2, :2].tolist() == [1, 1]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_table_and_a_copy_fed_only_its_changes_agree_with_every_block_list(data):
    table = BlockTable(max_blocks_per_seq=150, track_changes=True)
    lists: dict[str, list[int]] = {}
    mirror = np.zeros_like(table.table)
    names = iter(range(10**6))
    for _ in range(data.draw(st.integers(1, 60))):
        op = data.draw(st.sampled_from(["add", "grow", "grow", "cow", "free_front", "trim", "drop", "step"]))
        live = sorted(lists)
        if op == "add" or not live:
            lists[f"r{next(names)}"] = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=70))
        else:
            rid = data.draw(st.sampled_from(live))
            ids = lists[rid]
            if op == "grow":
                ids.extend(data.draw(st.lists(st.integers(0, 999), max_size=20)))
                del ids[150:]
            elif op == "cow":
                ids[-1] = data.draw(st.integers(0, 999))
            elif op == "free_front":
                holes = ids.count(NULL_BLOCK)
                for i in range(holes, min(len(ids) - 1, holes + data.draw(st.integers(0, 5)))):
                    ids[i] = NULL_BLOCK
            elif op == "trim":  # rejected blocks given back (told), then the list grows again
                # (behind the computed tokens, which no window has left yet)
                keep = data.draw(st.integers(min(ids.count(NULL_BLOCK) + 1, len(ids)), len(ids)))
                table.cut(rid, keep)
                ids[keep:] = data.draw(st.lists(st.integers(0, 999), max_size=20))
                del ids[150:]
            elif op == "drop":
                table.drop(rid)
                del lists[rid]
            else:  # a step of a subset, in row order
                step = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
                table.place_first(sorted(step, key=table.row_of))
        for rid, ids in lists.items():  # every step syncs its requests
            table.sync(rid, ids)
        grown = np.zeros_like(table.table)
        grown[:mirror.shape[0], :mirror.shape[1]] = mirror
        mirror = grown
        for row, start, end in table.take_changes():
            mirror[row, start:end] = table.table[row, start:end]
        assert np.array_equal(mirror, table.table)
        assert sorted(table.row_of(r) for r in lists) == list(range(len(lists)))
        for rid, ids in lists.items():
            assert table.table[table.row_of(rid), :len(ids)].tolist() == ids


def test_the_packed_changes_bring_a_device_copy_up_to_date():
    """What a runner's device (or a tensor-parallel worker) does with a packet's changed entries:
    packed from the host table, scattered into the copy, the copy grown where the table grew."""
    table = BlockTable(cdiv(400, 4), track_changes=True)  # max_model_len 400 in blocks of 4
    upload = StepUpload(torch.device("cpu"))
    for rid, ids in (("a", [1, 2, 3]), ("b", list(range(70))), ("a", [1, 9, 3, 4])):
        table.sync(rid, ids)
        changes = table.take_changes()
        packed = np.zeros(2 * sum(end - start for _, start, end in changes), dtype=np.int64)
        pack_changes(table.table, changes, packed)
        device = upload.update_table(torch.from_numpy(packed), table.table.shape)
        assert device.tolist() == table.table.tolist()
