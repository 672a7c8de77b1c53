"""Capture a model as one flat FX graph: the fx and export tracers, higher-order ops, and global-state guards."""
