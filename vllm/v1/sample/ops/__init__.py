"""Tensor kernels of the sampler: penalties, top-k/top-p/min-p thresholds, the race."""
