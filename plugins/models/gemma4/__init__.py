"""Gemma 4 (``model.py``): its settings (``config.py``) and decoder layer (``layers.py``)."""
