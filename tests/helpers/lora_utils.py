"""Tiny random Llama checkpoints with random PEFT LoRA adapters (saved the way PEFT saves them)."""

from __future__ import annotations

import torch

from model_utils import tiny_model_dir

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_llama(path, **overrides):
    """A tiny random Llama with a byte-level tokenizer of its own (servable); returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    return tiny_model_dir(path, "llama", **overrides)


def save_adapter(base_dir, path, *, seed: int, r: int = 4, alpha: int = 8, targets=ALL_TARGETS, rslora=False):
    """A random LoRA adapter of the model at ``base_dir`` saved at ``path`` (B non-zero, unlike a
    fresh PEFT adapter, so it changes the outputs). Returns the PEFT model (adapter unmerged)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(path))
    return model.eval()


def merged_logits(peft_model, ids: list[int]) -> torch.Tensor:
    """The reference: transformers' logits with the adapter merged into the base weights."""
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        return merged(torch.tensor([ids])).logits[0]
