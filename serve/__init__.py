"""tprt's server: gRPC and the OpenAI-compatible HTTP API, generation and fine-tuning jobs. Importing tprt first applies its process settings (tprt/__init__.py)."""

import tprt  # noqa: F401
