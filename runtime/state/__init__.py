"""A run's tensors on disk and in memory: materialising from meta, loading weights, exports and checkpoints."""
