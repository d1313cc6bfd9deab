"""Chained content hashes of full KV blocks, stable across processes and machines.

A block's hash covers its parent block's hash and its own token ids, so equal hashes mean
equal whole prefixes (up to a collision, which the manager rules out by also comparing the
stored tokens). The first block's parent is a root hash of the request's cache salt and LoRA
adapter (pagedllm.lora.request: its identity), so requests with different salts or adapters never
share blocks, and those of the same adapter do.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16  # blake2b-128
_ROOT_DOMAIN = b"pagedllm/prefix-cache/v1"
_LORA_ROOT_DOMAIN = b"pagedllm/prefix-cache/v1/lora"


def root_hash(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    if lora_key is None:  # the hashes the cache had before adapters existed
        return hashlib.blake2b(_ROOT_DOMAIN + salt, digest_size=HASH_BYTES).digest()
    # Another domain, and each part's length first: no salt and adapter pair reads as another.
    key = lora_key.encode("utf-8")
    data = _LORA_ROOT_DOMAIN + struct.pack("<QQ", len(salt), len(key)) + salt + key
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    # Fixed-width little-endian ints: the same bytes on every platform and process
    # (unlike hash(), which is salted per process).
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + packed, digest_size=HASH_BYTES).digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_blocks: int, cache_salt: str | None,
                        lora_key: str | None = None) -> list[bytes]:
    """Grow block_hashes in place to cover the first num_blocks full blocks of token_ids.

    Tokens are only ever appended, so hashes already in the list stay valid and each block
    is hashed once in the request's life (preemption included).
    """
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = block_hashes[-1] if block_hashes else root_hash(cache_salt, lora_key)
    for i in range(len(block_hashes), num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        block_hashes.append(parent)
    return block_hashes
