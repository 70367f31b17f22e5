"""LoRA adapters, for inference and training alike."""
