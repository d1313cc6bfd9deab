"""One process's model work: the runner (a scheduler output into tensors, the model, the
logits), the block tables it uploads, and the sampler."""
