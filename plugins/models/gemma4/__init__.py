"""Gemma 4 (``model.py``), on the text stack in ``llmkit.core.model.gemma4``."""
