"""Many LoRA adapters in one batch: each target projection is wrapped once at load, and every step
adds each token's own adapter's low-rank update to the base projection's output.

A wrapped projection holds room for max_loras adapters of rank up to max_rank (float32 on the CPU,
the model's dtype elsewhere): A [max_loras, P * R, in] and B transposed, [max_loras, R, out] (the
kernel then adds B's rows along the output), P being the projections fused into it (3 for q/k/v,
2 for gate/up, 1 for o and down). Part p's A rows are [p * R, p * R + r), and its B rows [0, r)
over the part's own output columns (part_cols), scaled by alpha / r at load; the rest is zeros.
The parts' columns never overlap, so their B blocks share R rows: no zero blocks stored or
multiplied (they took a third of the arithmetic and 150 MB of 16 rank-16 slots on SmolLM2). So one
adapter is a small matmul per projection into P R values, then one per part into its columns,
over exactly its tokens; an empty slot or part adds nothing.

Which token uses which slot is the model's LoRAState, set by the runner before each forward (one
per model, not global). On the CPU the tier's compiled kernel (csrc/lora.cpp) adds every token's
own update in one call per projection. Elsewhere (a GPU, the portable tier) tokens are sorted by
slot once per step (Punica's segmented idea), and each projection gathers the adapters' tokens at
most once, runs one pair of matmuls per adapter present over its segment, and adds the result back
at once. The base's tokens cost nothing either way.

The embeddings and the LM head take adapters too (PEFT's embed_tokens and lm_head targets): the
embeddings' updates are added to the base's lookup before anything else (before Gemma's scale,
as PEFT applies it to both), the head's to the float32 logits, over the rows the runner samples
(LoRAState.select_rows), whichever kernel computed them; a greedy step whose sampled rows use
no head adapter keeps the head's argmax-only kernel. Their slots cost 2 x max_loras x max_rank
x vocab floats (16 x 16 on SmolLM2's 49k vocabulary: 100 MB in float32).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.kernels import tiers
from pagedllm.lora.adapter import MODEL_WIDE
from pagedllm.model.config import ModelConfig


class LoRAState:
    """The current batch's tokens grouped by adapter slot, as segments (slot, start, end): rows of
    the batch itself where every adapter's tokens are one run (no gather), else rows of the
    batch's LoRA tokens gathered in slot order (`rows`: their indices), one gather and one scatter
    per projection whatever the number of adapters."""

    def __init__(self, with_head: bool = True) -> None:
        self.segments: list[tuple[int, int, int]] = []
        self.rows: torch.Tensor | None = None
        self.token_slots: torch.Tensor | None = None  # int64 [T], for the compiled kernel
        self.slots = np.empty(0, dtype=np.int64)
        self.device: torch.device | str = "cpu"
        # The rows the LM head gets (only those that are sampled, in the runner): their own state,
        # every token of the batch until select_rows picks some.
        self.head = LoRAState(with_head=False) if with_head else None

    def set_batch(self, token_slots, device: torch.device | str = "cpu") -> None:
        """token_slots[t]: the slot of token t's adapter, -1 for the base model (a sequence or
        numpy array)."""
        self.segments, self.rows = [], None
        slots = np.ascontiguousarray(np.asarray(token_slots, dtype=np.int64))
        self.slots, self.device = slots, device
        self.token_slots = torch.from_numpy(slots).to(device)
        if self.head is not None:
            self.head.set_batch(slots, device)
        lora_rows = np.flatnonzero(slots >= 0)
        if not lora_rows.size:
            return
        order = lora_rows[np.argsort(slots[lora_rows], kind="stable")]
        sorted_slots = slots[order]
        bounds = np.flatnonzero(np.diff(sorted_slots)) + 1
        starts, ends = np.r_[0, bounds], np.r_[bounds, len(order)]
        one_run_each = all(order[e - 1] - order[s] == e - 1 - s for s, e in zip(starts, ends))
        if one_run_each:  # segments over the batch's own rows
            self.segments = [(int(sorted_slots[s]), int(order[s]), int(order[e - 1]) + 1)
                             for s, e in zip(starts, ends)]
        else:
            self.segments = [(int(sorted_slots[s]), int(s), int(e)) for s, e in zip(starts, ends)]
            self.rows = torch.from_numpy(order).to(device)

    def select_rows(self, rows) -> None:
        """The LM head's rows from now on: rows of the batch (indices, in the order the head gets
        them)."""
        rows = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, dtype=np.int64)
        self.head.set_batch(self.slots[rows], self.device)

    def clear(self) -> None:
        self.segments, self.rows, self.token_slots = [], None, None
        self.slots = np.empty(0, dtype=np.int64)
        if self.head is not None:
            self.head.clear()


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, part_rows: list[int], in_features: int, state: LoRAState,
                 max_loras: int, max_rank: int, like: torch.Tensor) -> None:
        """like: a tensor of the model's activation dtype and device (the updates' own, whatever
        the base projection stores: float, prepacked or quantized). base None: only add_update
        runs (the LM head's updates, added to logits the model computes)."""
        super().__init__()
        if getattr(base, "gated_silu", False):  # its SiLU-and-mul would come before our update
            raise ValueError("a LoRA projection cannot wrap a gated, prepacked gate/up projection")
        self.base = base
        self.state = state
        self.part_rows = part_rows  # the output rows of each fused part, in order
        self.max_rank = max_rank
        parts, out_features = len(part_rows), sum(part_rows)
        self.register_buffer("lora_a", torch.zeros(max_loras, parts * max_rank, in_features,
                                                   dtype=like.dtype, device=like.device))
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, out_features,
                                                   dtype=like.dtype, device=like.device))
        offsets = [0]
        for rows in part_rows:
            offsets.append(offsets[-1] + rows)
        self.register_buffer("part_cols", torch.tensor(offsets, dtype=torch.int64, device=like.device))
        self._column_slices = [slice(start, end) for start, end in zip(offsets, offsets[1:])]
        # On the CPU the tier's compiled kernel adds every adapter's updates in one call
        # (csrc/lora.cpp: the cost of the arithmetic, whatever the number of adapters).
        ops = tiers.current().ops
        self.kernel = ops.lora_add_ if like.device.type == "cpu" and hasattr(ops, "lora_add_") else None
        self.active: set[int] = set()  # slots whose adapter updates this projection

    def updates_any(self) -> bool:
        """Whether a row of the current batch uses an adapter that updates this projection."""
        return any(slot in self.active for slot, _, _ in self.state.segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_update(self.base(x), x)

    def add_update(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base projection's output for x) plus each row's own adapter's update, in place."""
        segments, rows = self.state.segments, self.state.rows
        if not self.updates_any():  # the base's rows, or adapters that leave this projection be
            return y
        a, b = self.lora_a, self.lora_b
        if (self.kernel is not None and x.dim() == 2 and x.stride(-1) == 1 and y.stride(-1) == 1
                and x.dtype == y.dtype):
            self.kernel(y, x, a, b, self.state.token_slots, self.part_cols)
            return y
        if rows is None:  # each adapter's tokens are one run of the batch
            for slot, start, end in segments:
                y[start:end] += self._update(x[start:end].to(a.dtype), slot).to(y.dtype)
            return y
        xs = x.index_select(0, rows).to(a.dtype)
        delta = torch.empty(xs.shape[0], b.shape[2], dtype=a.dtype, device=x.device)
        for slot, start, end in segments:
            delta[start:end] = self._update(xs[start:end], slot)
        y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def _update(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """One adapter's update [n, out] of its tokens x [n, in]: each part's own A rows, then its
        columns of B."""
        h = x @ self.lora_a[slot].T
        if len(self._column_slices) == 1:
            return h @ self.lora_b[slot]
        rank, b = self.max_rank, self.lora_b[slot]
        return torch.cat([h[:, p * rank:(p + 1) * rank] @ b[:, cols]
                          for p, cols in enumerate(self._column_slices)], dim=1)

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 scaling: float) -> None:
        """Write one adapter into slot: parts maps a part's index to its (A [r, in], B [out_p, r])."""
        self.clear_slot(slot)
        rank_room = self.max_rank
        for part, (a, b) in parts.items():
            rows_start = sum(self.part_rows[:part])
            r = a.shape[0]
            cols = slice(part * rank_room, part * rank_room + r)
            self.lora_a[slot, cols] = a.to(self.lora_a.dtype)
            out_cols = slice(rows_start, rows_start + b.shape[0])
            self.lora_b[slot, :r, out_cols] = (b * scaling).T.to(self.lora_b.dtype)
        self.active.add(slot)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.active.discard(slot)


class LoRAEmbedding(nn.Module):
    """The embeddings' LoRA (PEFT's lora_embedding_A [r, vocab] and _B [hidden, r]): each token of
    an adapter gets row `token id` of its A, times B, added to the base's embedding. Held as A
    transposed [max_loras, vocab, R] (a token's rank-sized row is one read) and B transposed and
    scaled [max_loras, R, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, state: LoRAState, max_loras: int, max_rank: int,
                 like: torch.Tensor) -> None:
        super().__init__()
        self.state = state
        self.register_buffer("lora_a", torch.zeros(max_loras, vocab_size, max_rank,
                                                   dtype=like.dtype, device=like.device))
        self.register_buffer("lora_b", torch.zeros(max_loras, max_rank, hidden_size,
                                                   dtype=like.dtype, device=like.device))
        self.active: set[int] = set()  # slots whose adapter updates the embeddings

    def add_update(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x (the base's embeddings of input_ids) plus each token's own adapter's update, in place."""
        rows = self.state.rows
        segments = [segment for segment in self.state.segments if segment[0] in self.active]
        if not segments:
            return x
        a, b = self.lora_a, self.lora_b
        if rows is None:  # each adapter's tokens are one run of the batch
            for slot, start, end in segments:
                x[start:end] += (a[slot][input_ids[start:end]] @ b[slot]).to(x.dtype)
            return x
        ids = input_ids.index_select(0, rows)
        delta = torch.zeros(ids.shape[0], b.shape[2], dtype=a.dtype, device=x.device)  # some stay 0
        for slot, start, end in segments:
            torch.matmul(a[slot][ids[start:end]], b[slot], out=delta[start:end])
        x.index_add_(0, rows, delta.to(x.dtype))
        return x

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 scaling: float) -> None:
        """Write one adapter into slot: parts {0: (A [r, vocab], B [hidden, r])}."""
        self.clear_slot(slot)
        a, b = parts[0]
        r = a.shape[0]
        self.lora_a[slot, :, :r] = a.T.to(self.lora_a.dtype)
        self.lora_b[slot, :r] = (b * scaling).T.to(self.lora_b.dtype)
        self.active.add(slot)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.active.discard(slot)


def wrap_model(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAState, dict]:
    """Wrap every LoRA target of model (before prepacking); (its state, {(layer, our module name):
    LoRALinear}, the embeddings and LM head under layer MODEL_WIDE). A mixture-of-experts layer's experts
    are not targets."""
    config: ModelConfig = model.config
    state = LoRAState()
    # The updates' dtype: the model's on a GPU; float32 on the CPU, where a bf16 matmul of a
    # decode's few rows by a rank's few columns ran 5x slower than float32 (oneDNN, no AMX).
    norm = model.norm.weight
    like = norm if norm.device.type != "cpu" else norm.float()
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    targets = {"self_attn.qkv_proj": ([q_size, kv_size, kv_size], hidden),
               "self_attn.o_proj": ([hidden], q_size)}
    wrapped = {}
    for i, layer in enumerate(model.layers):
        layer_targets = dict(targets)
        if not config.is_moe_layer(i):
            layer_targets.update({"mlp.gate_up_proj": ([inter, inter], hidden),
                                  "mlp.down_proj": ([hidden], inter)})
        for name, (part_rows, in_features) in layer_targets.items():
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            module = LoRALinear(getattr(parent, attr), part_rows, in_features, state, max_loras, max_rank,
                                like)
            setattr(parent, attr, module)
            wrapped[(i, name)] = module
    # The embeddings and the LM head: model-wide, under layer MODEL_WIDE. The head's updates are added to
    # the logits the model computes (whatever kernel runs the head), over the rows it is given.
    model.lora_embedding = LoRAEmbedding(config.vocab_size, hidden, state, max_loras, max_rank, like)
    model.lora_head = LoRALinear(None, [config.vocab_size], hidden, state.head, max_loras, max_rank, like)
    wrapped[(MODEL_WIDE, "embed_tokens")] = model.lora_embedding
    wrapped[(MODEL_WIDE, "lm_head")] = model.lora_head
    return state, wrapped
