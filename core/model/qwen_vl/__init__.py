"""What the Qwen vision-language families share (Qwen2.5-VL, Qwen3-VL, Qwen3.5 with images):
the image rows and M-RoPE table on a text decoder, the processor, and both vision towers."""
