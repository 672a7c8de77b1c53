"""What each node costs: FLOPs, bytes and time per node, devices and clusters, precision and recomputation."""
