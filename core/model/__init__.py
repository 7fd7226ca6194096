"""Models: the CausalLM and attention-backend contracts, the shared layers (the one linear layer,
norms and rotary embeddings, batched MoE experts) and, one folder down, weight formats
(``quant/``), weight loading (``loader/``), the CPU C kernels (``cpu/``) and the decoder stacks
the model plugins build on (``decoder/``)."""
