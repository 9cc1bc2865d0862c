"""Kernels the trainer and the engine share: batch-invariant matmul/attention and paged attention."""
