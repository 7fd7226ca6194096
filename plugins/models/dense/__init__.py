"""Dense decoders on the shared Llama-style stack (``core/model/decoder/``) with their own twists:
Mistral (sliding window), Phi-3/Phi-4 (fused projections, LongRoPE), SmolLM3 (NoPE layers), OLMo 2/3
(post-norms, whole-projection Q/K norms), Granite (scaling multipliers)."""
