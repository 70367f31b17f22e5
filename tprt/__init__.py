"""tprt: tensor-parallel checkpoints and runtime for Llama models."""

__version__ = "0.1.0"
