"""The model tests' tiny checkpoints, shared with these."""

from tests.model.conftest import tiny_checkpoint  # noqa: F401 (a fixture)
