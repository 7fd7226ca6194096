"""Gemma 4's text stack: its settings (``config.py``) and decoder layer (``layers.py``), which the
model plugins (``plugins/models/gemma4/``: the text model; the multimodal one builds on the same
layers) share."""
