"""The kinds of page one KV pool holds. Every page is the same size (one block: block_size tokens
of every attention layer's keys and values); what an owned page holds differs:

- the model's keys and values for block_size tokens, in a request's block table (shared between
  requests by copy-on-write and the prefix cache), named by what the model keeps there: FULL_ATTENTION,
  SLIDING_WINDOW (every layer windowed: pages fall out of the window) or MLA_LATENT (multi-head
  latent attention's one latent per token);
- RECURRENT_STATE: part of one request's recurrent state (a hybrid model's linear layers), a fixed
  number of pages per request, never shared (a fork gets copies).
"""

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MLA_LATENT = "mla_latent"
RECURRENT_STATE = "recurrent_state"


def kv_page_kind(sliding_window: int | None, latent: bool) -> str:
    """What a model's KV pages hold."""
    if latent:
        return MLA_LATENT
    return FULL_ATTENTION if sliding_window is None else SLIDING_WINDOW
