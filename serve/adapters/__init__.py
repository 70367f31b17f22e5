"""LoRA adapters on rank 0: the registry of ids and the pool of tiers."""
