"""kt.gpu_ops."""
