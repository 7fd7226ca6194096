"""Models and their memory: the CausalLM and attention-backend contracts, shared layers, the paged
KV pool and the radix prefix cache, batched MoE experts, and weight loading (safetensors, GGUF, MXFP4,
block FP8, dummy weights)."""
