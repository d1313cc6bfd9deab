"""The adapter's identity is part of the prefix cache's block hashes: a request of adapter A
never reuses a block cached under adapter B (nor the base's, nor the other way round), and
requests of the same adapter share blocks (exact block ids). Pure Python: the KV manager alone."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv import prefix_hash
from pagedllm.core.kv.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.lora.request import LoRARequest
from tests.core.kv.test_prefix_cache import admit, finish

A = LoRARequest("a", 1, "/adapters/a").key
B = LoRARequest("b", 2, "/adapters/b").key
PROMPT = list(range(9))  # two full blocks of 4 and one token


def test_adapters_never_share_blocks_and_the_same_adapter_does():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(manager, first_a := Request("a1", PROMPT, lora_key=A))
    a_blocks = manager.block_ids(first_a)[:2]
    admit(manager, first_b := Request("b1", PROMPT, lora_key=B))  # while a1 still holds its blocks
    b_blocks = manager.block_ids(first_b)[:2]
    assert not set(a_blocks) & set(b_blocks)
    finish(manager, first_a)
    finish(manager, first_b)
    # Both chains are cached and free now: each adapter finds exactly its own.
    hit_a = manager.find_cached_prefix(Request("a2", PROMPT, lora_key=A))
    assert [b.block_id for b in hit_a.blocks] == a_blocks
    hit_b = manager.find_cached_prefix(Request("b2", PROMPT, lora_key=B))
    assert [b.block_id for b in hit_b.blocks] == b_blocks
    assert manager.find_cached_prefix(Request("base", PROMPT)).num_tokens == 0
    salted = Request("salted", PROMPT, cache_salt="t", lora_key=A)
    assert manager.find_cached_prefix(salted).num_tokens == 0
    # And the base's blocks are the base's alone.
    admit(manager, base := Request("base", PROMPT))
    base_blocks = manager.block_ids(base)[:2]
    finish(manager, base)
    assert not set(base_blocks) & (set(a_blocks) | set(b_blocks))
    assert [b.block_id for b in manager.find_cached_prefix(Request("c", PROMPT)).blocks] == base_blocks


@settings(max_examples=60, deadline=None)
@given(salt=st.one_of(st.none(), st.text(max_size=6)), key=st.text(max_size=6),
       other_salt=st.one_of(st.none(), st.text(max_size=6)),
       other_key=st.one_of(st.none(), st.text(max_size=6)))
def test_root_hashes_tell_every_salt_and_adapter_apart(salt, key, other_salt, other_key):
    same = (salt, key) == (other_salt, other_key)
    assert (prefix_hash.root_hash(salt, key) == prefix_hash.root_hash(other_salt, other_key)) == same


def test_a_fork_keeps_its_adapter():
    parent = Request("p", [1, 2, 3], lora_key=A, lora_slot=2)
    parent.append_token(7)
    child = parent.fork("p#1", 8)
    assert (child.lora_key, child.lora_slot, child.prefix_salt) == (A, 2, (None, A))
