"""The generated protobuf and gRPC modules (built on first import; see serve/protos.py)."""

from serve.protos import load

_mods = load()
generation_pb2 = _mods["generation_pb2"]
generation_pb2_grpc = _mods["generation_pb2_grpc"]
finetuning_pb2 = _mods["finetuning_pb2"]
finetuning_pb2_grpc = _mods["finetuning_pb2_grpc"]

__all__ = ["finetuning_pb2", "finetuning_pb2_grpc", "generation_pb2", "generation_pb2_grpc"]
