"""GPU kernels (Triton): imported only where Triton is installed (CUDA builds of torch ship it)."""
