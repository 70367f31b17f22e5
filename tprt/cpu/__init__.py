"""CPU-only speed: compiled kernels (`native`), weights in their kernel's layout (`fast_linear`),
transparent huge pages (`hugepages`) and thread set-up (`threads`). Nothing here changes results
beyond summation order, and everything is optional."""
