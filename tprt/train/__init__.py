"""Fine-tuning: TP-correct gradients (`grads`), LoRA (`lora`), the optimizer (`optim`), the loss
and activation checkpointing (`step`), and the data pipeline, trainer and checkpoints built on
them. Submodules are imported explicitly; this package imports nothing on its own."""
