"""Weight formats: how a linear layer or the MoE experts hold their weights and multiply by them.
``weight_formats`` holds the ``--quantization`` name table; ``int8`` its int8; ``int4_format`` (CPU) and
``int4_triton`` (CUDA) the 4-bit groups GGUF Q4, GPTQ and AWQ map onto; ``gguf_quant`` the GGUF
blocks that stay quantized; ``fp8`` and ``mxfp4`` the checkpoint encodings dequantized at load."""
