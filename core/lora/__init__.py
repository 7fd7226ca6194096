"""LoRA adapters served over the base model: PEFT checkpoints fitted to the fused projections,
added per row on the layers' outputs, mixed freely in one batch."""
