"""CPU-only speed: compiled kernels (`native`), weights in their kernel's layout (`fast_linear`),
the decode layers and decoder stack that run those kernels (`native_layers`), transparent huge
pages (`hugepages`) and thread set-up (`threads`). Nothing here changes results beyond summation
order, and everything is optional."""
