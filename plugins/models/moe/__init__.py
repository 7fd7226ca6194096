"""Mixture-of-experts decoders on the shared stack: Mixtral, GLM-4.5/4.6/4.7, MiniMax-M2 (their
routing in ``core/model/decoder/routed_moe.py`` and DeepSeek's ``core/model/decoder/deepseek.py``)."""
