"""Tensor-parallel building blocks: the communication operators (`mappings`), the layers that use
them (`layers`; each linear's weights are owned by its `LinearMethod`), vocab-parallel
cross-entropy (`cross_entropy`), the per-parameter TP spec (`spec`) and the table of how each
Llama weight is split (`sharding`, torch-free: the converter imports it, so this package imports
nothing itself)."""
