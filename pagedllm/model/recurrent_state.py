"""A hybrid model's recurrent states, held in pages of the one KV pool.

The KV manager gives each request of a hybrid model a fixed number of state pages beside its KV
blocks (KVCacheManager's state_pages_per_request, from pages_per_request below). A page is the
memory of one KV block: block p of every attention layer's key and value caches, all views into
one allocation laid out [layers, sides, blocks, block bytes]. A request's state, every recurrent
layer's tensors as float32 laid end to end, is cut into its pages in order, each page's bytes
taken layer by layer, side by side: so copying a page as a KV block (copy_blocks: a fork's
copy) copies that part of the state, and nothing else in the pool moves.

Each step the model gathers the states of its requests into dense tensors (zeros for a request
whose first tokens these are: a new one, or one preempted and recomputed from its prompt), the
layers update them, and the model writes them back.
"""

from __future__ import annotations

import math

import torch

from pagedllm.kernels.attention import KVCache

_STATE_DTYPE = torch.float32


def state_bytes(shapes: list[tuple[int, ...]]) -> int:
    """Bytes of one request's state: float32 tensors of these shapes."""
    return sum(math.prod(shape) for shape in shapes) * _STATE_DTYPE.itemsize


def pages_per_request(shapes: list[tuple[int, ...]], bytes_per_page: int) -> int:
    return -(-state_bytes(shapes) // bytes_per_page)


class StatePages:
    """Reads and writes requests' states [B, *shape] (one per shape) in their pages."""

    def __init__(self, kv_caches: list[KVCache], shapes: list[tuple[int, ...]]):
        keys = kv_caches[0][0]
        pool = keys._base  # the one allocation every layer's caches are views of
        if not isinstance(keys, torch.Tensor) or pool is None or not pool.is_contiguous():
            raise ValueError("recurrent states need the KV caches as views of one allocation in the "
                             "model's dtype (no compressed kv_cache_dtype)")
        num_chunks, num_blocks = pool.shape[0] * pool.shape[1], pool.shape[2]
        pool_bytes = pool.view(num_chunks, num_blocks, -1).view(torch.uint8)  # [chunks, blocks, bytes]
        # Moved in float32-sized words where a block's bytes allow (rows of bytes copy ~4x slower),
        # so a gathered state is its float32 values as they are.
        self.word = _STATE_DTYPE if pool_bytes.shape[2] % _STATE_DTYPE.itemsize == 0 else torch.uint8
        # [blocks, chunks, words]: a page's memory, in the pool's order (a view, not a copy)
        self.by_page = pool_bytes.view(self.word).transpose(0, 1)
        self.sizes = [math.prod(shape) for shape in shapes]
        self.shapes = shapes
        self.caches = kv_caches  # what the pages are views of (the model keeps one store per list)
        self.num_bytes = state_bytes(shapes)
        self.num_words = self.num_bytes // self.word.itemsize
        page_bytes = self.by_page.shape[1] * self.by_page.shape[2] * self.word.itemsize
        self.pages_per_request = -(-self.num_bytes // page_bytes)

    def read(self, page_ids: torch.Tensor, fresh: torch.Tensor) -> list[torch.Tensor]:
        """The states of B requests whose pages are page_ids [B, pages]; zeros where fresh [B]."""
        batch = page_ids.shape[0]
        # One gather: [B x pages, chunks, words] -> each request's pages end to end.
        flat = self.by_page[page_ids.reshape(-1)].view(batch, -1)[:, :self.num_words]
        if self.word is not _STATE_DTYPE:
            flat = flat.contiguous().view(_STATE_DTYPE)
        flat[fresh] = 0
        return [part.reshape(batch, *shape)
                for part, shape in zip(flat.split(self.sizes, dim=1), self.shapes)]

    def write(self, page_ids: torch.Tensor, states: list[torch.Tensor]) -> None:
        batch, num_pages = page_ids.shape
        _, chunks, chunk_words = self.by_page.shape
        padding = num_pages * chunks * chunk_words - self.num_words
        parts = [s.reshape(batch, -1).to(_STATE_DTYPE).view(self.word) for s in states]
        flat = torch.cat([*parts, parts[0].new_zeros(batch, padding)], dim=1)
        self.by_page[page_ids.reshape(-1)] = flat.view(batch * num_pages, chunks, chunk_words)
