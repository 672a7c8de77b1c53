"""Data parallelism around the pipeline: replica gradient averaging, optimizer sharding, tied weights, clipping."""
