"""Serving many LoRA fine-tunes of one base model at once: adapters read and checked (adapter.py),
the base's projections wrapped to add each token's adapter (layers.py), slots loaded and freed at
runtime (manager.py)."""
