"""``Gemma3ForCausalLM``: Gemma 3's text checkpoints (model_type ``gemma3_text``), on the text stack
``core/model/gemma3/text.py`` shares with the image-text model (``gemma3_vl.py``)."""

from __future__ import annotations

from llmkit.core.model.gemma3.text import Gemma3TextModel


class Gemma3ForCausalLM(Gemma3TextModel):
    pass
