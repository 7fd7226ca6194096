"""A tiny random-weight Whisper built offline: transformers' ``WhisperForConditionalGeneration``
from a small ``WhisperConfig``, a real ``WhisperTokenizer`` (a byte-level BPE trained here on a few
sentences, with Whisper's special tokens in Whisper's order: end of text right after the BPE
vocabulary, then start, the 99 languages, the tasks, no-timestamps and the 1,501 timestamps),
its generation config (language and task tokens) and feature extractor config."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = ["the quick brown fox jumps over the lazy dog", "speech to text from every container", "hello world"]


def whisper_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT * 5, vocab_size=400, min_frequency=1, show_progress=False)
    merges = [tuple(m) for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]]
    tok = WhisperTokenizer(vocab=bpe.get_vocab(), merges=merges)
    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES)]
    specials += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>"]
    specials += ["<|notimestamps|>", *(f"<|{i * 0.02:.2f}|>" for i in range(1501))]
    tok.add_tokens(specials, special_tokens=True)
    return tok


def tiny_whisper(path: Path, *, seed: int = 0, n_mels: int = 80, multilingual: bool = True):
    """Write a tiny Whisper checkpoint to ``path``; returns transformers' model (the reference)."""
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tok = whisper_tokenizer()
    ids = tok.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    space = tok.convert_tokens_to_ids("Ġ")
    config = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=n_mels,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=24,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        # every special token but the end (a trained Whisper writes none of them in text; random
        # weights would, and the text would decode empty)
        suppress_tokens=list(range(sot, len(tok))),
        begin_suppress_tokens=[space, eot],
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the init's: outputs that differ from window to window
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    gen = GenerationConfig.from_model_config(config)
    gen.lang_to_id = {f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES} if multilingual else None
    gen.is_multilingual = multilingual
    gen.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
    gen.no_timestamps_token_id = ids("<|notimestamps|>")
    gen.prev_sot_token_id = ids("<|startofprev|>")
    gen.max_initial_timestamp_index = 50
    gen.max_length = 24
    model.generation_config = gen
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(path)
    return model
