"""The gRPC front end: tprt.v1.Generation and FineTuning over the generated code (serve/protos.py)."""
