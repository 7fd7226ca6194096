"""Ollama's API (/api/*), translated onto the OpenAI routes' chat and embedding runs."""
