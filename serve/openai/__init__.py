"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn)."""
