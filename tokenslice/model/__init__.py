"""Model code: checkpoints, layers, paged attention, the runner that owns the KV tensors."""
