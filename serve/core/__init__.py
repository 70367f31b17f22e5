"""Front-end-neutral generation: the engine loop on rank 0, its tickets, output constraints and tools."""
