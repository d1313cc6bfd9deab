"""Suffix trees and suffix decoding against brute force: substring counts by scanning every text,
and the proposal rule read straight from the module docstring."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.suffix import SuffixProposer, SuffixTree

ALPHABET = st.integers(0, 3)


def count(texts: list[list[int]], w: list[int]) -> int:
    n = len(w)
    return sum(1 for t in texts for i in range(len(t) - n + 1) if t[i:i + n] == w)


def continuations(texts: list[list[int]], w: list[int]) -> dict[int, int]:
    n = len(w)
    found: dict[int, int] = {}
    for t in texts:
        for i in range(len(t) - n):
            if t[i:i + n] == w:
                found[t[i + n]] = found.get(t[i + n], 0) + 1
    return found


def speculate(texts, depth, w, cap, min_prob) -> tuple[list[int], float]:
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    current = list(w)
    while len(tokens) < cap and len(current) < depth:
        options = continuations(texts, current)
        if not options:
            break
        token = max(options, key=lambda t: (options[t], -t))
        prob *= options[token] / count(texts, current)
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        current.append(token)
    return tokens, score


def reference_proposal(own: list[int], shared: list[list[int]], depth, k, factor, min_prob) -> list[int]:
    best_key, best = None, []
    for m in range(min(len(own), depth - 1), 0, -1):
        cap = min(k, int(m * factor), depth - m)
        if cap <= 0:
            continue
        w = own[len(own) - m:]
        for rank, texts in ((0, [own]), (1, shared)):
            if not texts or not count(texts, w):
                continue
            tokens, score = speculate(texts, depth, w, cap, min_prob)
            if tokens and (best_key is None or (score, m, -rank) > best_key):
                best_key, best = (score, m, -rank), tokens
    return best


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.lists(ALPHABET, max_size=30), min_size=1, max_size=5),
       depth=st.integers(2, 6), removed=st.lists(st.integers(0, 4), max_size=3),
       probes=st.lists(st.lists(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=10))
def test_counts_match_brute_force(texts, depth, removed, probes):
    tree = SuffixTree(depth)
    handles = [tree.add_text(t) for t in texts]
    kept = list(range(len(texts)))
    for i in dict.fromkeys(removed):
        if i < len(texts):
            tree.remove_text(handles[i])
            kept.remove(i)
    live = [texts[i] for i in kept]
    for w in probes + [t[a:a + depth] for t in live for a in range(len(t))]:
        w = w[:depth]
        assert tree.count(w) == count(live, w), w
        if len(w) < depth:
            assert tree.continuations(w) == continuations(live, w), w
    assert tree.root.count == sum(len(t) for t in live)


@settings(max_examples=200, deadline=None)
@given(text=st.lists(ALPHABET, max_size=40), depth=st.integers(2, 6),
       probes=st.lists(st.lists(ALPHABET, min_size=1, max_size=6), max_size=10))
def test_growing_text_counts(text, depth, probes):
    """A text appended token by token (the open text) counts like one added whole, at every length."""
    tree = SuffixTree(depth)
    tree.open_text()
    for n, token in enumerate(text, 1):
        tree.append(token)
        prefix = text[:n]
        for w in probes + [prefix[-m:] for m in range(1, min(depth, n) + 1)]:
            w = w[:depth]
            assert tree.count(w) == count([prefix], w)
        # The open text's suffix nodes are exactly its suffixes seen before, shorter than depth.
        want = {m for m in range(1, min(depth - 1, n) + 1) if count([prefix], prefix[-m:]) > 1}
        assert {node.depth for node in tree.open_suffix_nodes} == want


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int


@settings(max_examples=150, deadline=None)
@given(data=st.data(), depth=st.integers(2, 7), k=st.integers(1, 6),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]),
       max_cached=st.integers(0, 3))
def test_proposals_match_reference(data, depth, k, factor, min_prob, max_cached):
    proposer = SuffixProposer(depth, max_cached, factor, min_prob)
    finished: OrderedDict[str, list[int]] = OrderedDict()  # the reference's shared cache
    live: dict[str, Seq] = {}
    for step in range(data.draw(st.integers(1, 25), "steps")):
        action = data.draw(st.sampled_from(["add", "grow", "grow", "grow", "finish"]), "action")
        if action == "add" or not live:
            prompt = data.draw(st.lists(ALPHABET, min_size=1, max_size=12), "prompt")
            rid = f"r{data.draw(st.integers(0, 6), 'id')}"
            if rid in live:
                continue
            live[rid] = Seq(rid, list(prompt), len(prompt))
        elif action == "grow":
            seq = data.draw(st.sampled_from(sorted(live.values(), key=lambda s: s.request_id)), "seq")
            seq.token_ids += data.draw(st.lists(ALPHABET, min_size=1, max_size=4), "tokens")
        else:
            seq = live.pop(data.draw(st.sampled_from(sorted(live)), "done"))
            proposer.forget(seq.request_id)
            output = seq.token_ids[seq.num_prompt_tokens:]
            if max_cached and output:
                finished.pop(seq.request_id, None)
                finished[seq.request_id] = output
                while len(finished) > max_cached:
                    finished.popitem(last=False)
        seqs = sorted(live.values(), key=lambda s: s.request_id)
        got = proposer.propose(seqs, [k] * len(seqs))
        want = [reference_proposal(s.token_ids, list(finished.values()), depth, k, factor, min_prob)
                for s in seqs]
        assert got == want, (step, [s.token_ids for s in seqs], list(finished.values()))


def test_hand_case_prefers_the_frequent_continuation():
    # "1 2" was followed by 3 twice and by 4 once: the proposal continues with 3.
    proposer = SuffixProposer(8, 0, 1.0, 0.0)  # depth, cached requests, spec factor, min prob
    seq = Seq("a", [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2], 14)
    assert proposer.propose([seq], [1]) == [[3]]


def test_shared_tree_remembers_finished_outputs():
    proposer = SuffixProposer(8, 1, 1.0, 0.0)  # depth, cached requests, spec factor, min prob
    proposer.propose([Seq("a", [0, 5, 6, 7, 8, 9], 1)], [1])
    proposer.forget("a")  # its output 5 6 7 8 9 joins the shared tree
    assert proposer.propose([Seq("b", [1, 5, 6, 7], 1)], [2]) == [[8, 9]]
    proposer.propose([Seq("c", [0, 3], 1)], [1])
    proposer.forget("c")  # the cache holds one request: a's output leaves
    assert proposer.propose([Seq("d", [1, 5, 6, 7], 1)], [2]) == [[]]
    assert proposer.shared.num_nodes == 0


def test_tree_refuses_misuse():
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(1)
    tree = SuffixTree(3)
    with pytest.raises(ValueError, match="no open text"):
        tree.append(1)
    text = tree.open_text()
    with pytest.raises(ValueError, match="open text"):
        tree.remove_text(text)
