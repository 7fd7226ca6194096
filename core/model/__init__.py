"""Models and their memory: the CausalLM and attention-backend contracts, shared layers, the paged
KV pool and the radix prefix cache, and weight loading (safetensors, GGUF, dummy weights)."""
