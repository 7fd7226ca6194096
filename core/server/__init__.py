"""The OpenAI-compatible HTTP server (FastAPI)."""
