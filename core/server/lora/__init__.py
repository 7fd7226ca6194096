"""LoRA adapters at the HTTP edge: loading and unloading them while serving."""
