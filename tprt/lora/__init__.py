"""LoRA adapters, for inference and training alike (nothing here imports tprt.train).

- `config`: targets and hyper-parameters, validated;
- `modules`: the tensor-parallel LoRA modules (ColumnLoRA, RowLoRA);
- `sites`: where they attach on a model and how their factors shard;
- `attach`: build an adapter for a model, attach and detach it (`apply_lora` for training);
- `peft_io`: PEFT state dicts, adapter_config.json, reading an adapter directory;
- `merge`: folding attached adapters into the base weights;
- `method`: LoRA as a linear method wrapping the base layer's (`LoRAMethod`, `wrap`, `unwrap`);
- `routing`: adapters served side by side in `AdapterSlots`, each batch row routed to one.
"""
