"""Layers that keep a fixed-size recurrent state instead of K/V (hybrid models' linear-attention
and convolution layers), with their kernels; their state lives in ``core/kvcache/state_pool.py``."""
