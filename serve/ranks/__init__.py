"""Every serving rank's side of the rank commands (fine-tuning, adapters)."""
