"""Tensor parallelism priced: what a tp group splits, its all-reduces, the tp sizes a model takes."""
