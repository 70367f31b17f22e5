"""tprt's server: generation and fine-tuning jobs over gRPC and the OpenAI-compatible HTTP API.
Importing tprt first applies its process settings (tprt/__init__.py)."""

import tprt  # noqa: F401
