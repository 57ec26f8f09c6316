"""tkv.kernels."""
