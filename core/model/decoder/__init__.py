"""The decoder stacks model plugins build on (the contract they implement is ``causal_lm``'s).

``stack`` holds the Llama-style decoder (fused QKV and gate/up, the decode GEMVs, the C stack) and
the skeleton every built-in architecture shares (``StackedLM``, ``PreNormBlock``, ``MLP``,
``place_tensor``); ``mla`` multi-head latent attention; ``deepseek`` the DeepSeek block, shared by
its model plugin and the MTP draft layer. Model and speculative plugins import them from here,
never from one another.
"""
