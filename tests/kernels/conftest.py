"""The kernel tests run over every compiled tier this CPU runs (the `tier` fixture)."""

from tests.kernel_tiers import attention_tier, tier  # noqa: F401
