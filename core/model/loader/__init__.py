"""Where weights come from: a model's source (the embedded default, a GGUF file, a Hugging Face
directory) and its safetensors shards, the GGUF reader, GPTQ/AWQ int4 checkpoints, and random
weights for ``--load-format dummy``."""
