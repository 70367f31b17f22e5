"""tprt's gRPC server. Importing tprt first applies its process settings (tprt/__init__.py)."""

import tprt  # noqa: F401
