"""Running one rank's actions: the executor, message wiring, split backward, recomputation, micro-batches."""
