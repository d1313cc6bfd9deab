"""The core's state over plain integers: requests, the scheduler and the KV cache manager
(kv/). Nothing here imports torch."""
