"""Whether a model is a speech-to-text one (its config names an architecture registered with
``speech=True``), and building its :class:`SpeechEngine`: weights, features, task tokens, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from llmkit.core.plugins import PluginError, registry


def speech_model_dir(model_path: str | None) -> Path | None:
    """The model directory when its config names a speech-to-text architecture; else None."""
    if model_path is None:
        return None
    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        return None
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch is None:
        return None
    try:
        entry = registry().entry("model", arch)
    except PluginError:  # an architecture llmkit does not know: the generation engine says so
        return None
    return path if entry.meta.get("speech") else None


def start_speech_engine(model_dir: Path, *, device: str, dtype: str | None):
    """Load the model on the worker thread that will run it and return the started engine."""
    import torch
    from transformers import AutoTokenizer

    from llmkit.core.audio.features import WhisperFeatures
    from llmkit.core.speech.engine import SpeechEngine
    from llmkit.core.speech.prompt import WhisperPrompt

    config = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen.setdefault("decoder_start_token_id", config.get("decoder_start_token_id"))
    gen.setdefault("eos_token_id", config.get("eos_token_id"))
    for key in ("suppress_tokens", "begin_suppress_tokens"):
        gen.setdefault(key, config.get(key))
    pre_path = model_dir / "preprocessor_config.json"
    features = WhisperFeatures.from_config(json.loads(pre_path.read_text()) if pre_path.is_file() else {})
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype or "float32", torch.float32
    )

    def build() -> SpeechEngine:
        arch = config["architectures"][0]
        cls = registry().model(arch)
        model = cls.from_pretrained(model_dir, config, torch.device(device), torch_dtype)
        if model.n_mels != features.n_mels:
            raise ValueError(f"the model reads {model.n_mels} mel bins; its preprocessor makes {features.n_mels}")
        prompt = WhisperPrompt.from_generation_config(gen, model.max_target_positions)
        detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        return SpeechEngine(model, features, prompt, detokenize, device=device, start=False)

    return SpeechEngine.build_and_start(build), tok
