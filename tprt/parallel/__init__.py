"""Tensor-parallel building blocks: communication operators and the layers that use them."""

from tprt.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from tprt.parallel.mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "copy_to_region",
    "gather_from_region",
    "reduce_from_region",
    "scatter_to_region",
]
