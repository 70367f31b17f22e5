"""Fine-tuning: TP-correct gradients (`grads`), the optimizer (`optim`), the loss and activation
checkpointing (`step`), FSDP over DP (`fsdp`), the data pipeline (`data`, `preference`), the
trainer and its DPO objective (`trainer`, `dpo`, `dpo_advice`), checkpoints and exports built on
them. LoRA itself is `tprt.lora`. Submodules are imported explicitly; this package imports nothing
on its own."""
