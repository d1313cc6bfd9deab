"""One process's model work: the executor (a scheduler output in, logits and prompt logprobs out),
the runner it drives (one rank's batch: tensors, the model, the logits), the packet and its upload
to the device, the block tables, CUDA graphs, and the sampler."""
