"""Whisper (``WhisperForConditionalGeneration``): a speech encoder and a text decoder.

Encoder: two GELU convolutions (the second halves the frames: 3,000 -> 1,500 for 30 s), learned
positions added, pre-LN transformer layers, a final LayerNorm. Decoder: token and learned position
embeddings, pre-LN layers of causal self-attention, cross-attention to the encoder's states and a
GELU feed-forward, a final LayerNorm; the output projection is the token embedding (tied). Keys
have no bias in Whisper's attention (queries, values and outputs do).

The cross-attention K/V of every layer is computed once per window in ``encode``; the decoder's
self-attention K/V grows one step at a time in a plain cache (the engine's paged pools are a later
step: see the issue).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.loader.source import iter_safetensors
from llmkit.core.speech.model import SpeechToText

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
        q = self.split(self.q_proj(x))
        # causal only when the queries are the whole sequence (a prefix); a later step sees all keys
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1)
        b, h, n, hd = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h * hd))


class _EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, act) -> None:
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = _Attention(d, heads), nn.LayerNorm(d)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(d, ffn), nn.Linear(ffn, d), nn.LayerNorm(d)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(h, *self.self_attn.kv(h))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class _DecoderLayer(_EncoderLayer):
    def __init__(self, d: int, heads: int, ffn: int, act) -> None:
        super().__init__(d, heads, ffn, act)
        self.encoder_attn, self.encoder_attn_layer_norm = _Attention(d, heads), nn.LayerNorm(d)

    def step(self, x: torch.Tensor, cache: list, cross: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.kv(h)
        if cache:  # the keys and values of the tokens fed before
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        x = x + self.self_attn.attend(h, k, v, causal=True)
        x = x + self.encoder_attn.attend(self.encoder_attn_layer_norm(x), *cross)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


@dataclass
class WhisperState:
    """One batch of windows being decoded: per layer, the cross K/V and the self-attention cache."""

    cross: list[tuple[torch.Tensor, torch.Tensor]]
    cache: list[list] = field(default_factory=list)
    length: int = 0  # tokens fed so far (the next token's position)


class WhisperForConditionalGeneration(nn.Module, SpeechToText):
    def __init__(self, config: dict) -> None:
        super().__init__()
        d, act = config["d_model"], _ACTIVATIONS[config.get("activation_function", "gelu")]
        self.n_mels = config.get("num_mel_bins", 80)
        self.vocab_size = config["vocab_size"]
        self.max_target_positions = config.get("max_target_positions", 448)
        self.embed_scale = d**0.5 if config.get("scale_embedding") else 1.0
        enc, dec = nn.Module(), nn.Module()
        enc.conv1 = nn.Conv1d(self.n_mels, d, 3, padding=1)
        enc.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        enc.embed_positions = nn.Embedding(config.get("max_source_positions", 1500), d)
        enc.layers = nn.ModuleList(
            _EncoderLayer(d, config["encoder_attention_heads"], config["encoder_ffn_dim"], act)
            for _ in range(config["encoder_layers"])
        )
        enc.layer_norm = nn.LayerNorm(d)
        dec.embed_tokens = nn.Embedding(self.vocab_size, d)
        dec.embed_positions = nn.Embedding(self.max_target_positions, d)
        dec.layers = nn.ModuleList(
            _DecoderLayer(d, config["decoder_attention_heads"], config["decoder_ffn_dim"], act)
            for _ in range(config["decoder_layers"])
        )
        dec.layer_norm = nn.LayerNorm(d)
        self.model = nn.Module()
        self.model.encoder, self.model.decoder = enc, dec

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device, dtype) -> WhisperForConditionalGeneration:
        model = cls(config)
        params = dict(model.named_parameters())
        seen = set()
        for name, tensor in iter_safetensors(Path(model_dir)):
            if name == "proj_out.weight":
                continue  # tied to the token embedding
            if name not in params:
                raise ValueError(f"unexpected weight '{name}' in the Whisper checkpoint")
            params[name].data.copy_(tensor)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"the Whisper checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def encode(self, features: torch.Tensor) -> WhisperState:
        enc = self.model.encoder
        dtype = enc.conv1.weight.dtype
        x = F.gelu(enc.conv1(features.to(enc.conv1.weight.device, dtype)))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)
        if x.shape[1] != enc.embed_positions.num_embeddings:
            raise ValueError(f"Whisper reads {2 * enc.embed_positions.num_embeddings} frames; got {features.shape[-1]}")
        x = x + enc.embed_positions.weight
        for layer in enc.layers:
            x = layer(x)
        states = enc.layer_norm(x)
        cross = [layer.encoder_attn.kv(states) for layer in self.model.decoder.layers]
        return WhisperState(cross, [[] for _ in cross])

    @torch.no_grad()
    def decode(self, state: WhisperState, tokens: torch.Tensor) -> torch.Tensor:
        dec = self.model.decoder
        n = tokens.shape[1]
        if state.length + n > self.max_target_positions:
            raise ValueError(f"Whisper's decoder holds {self.max_target_positions} tokens a window")
        positions = dec.embed_positions.weight[state.length : state.length + n]
        x = dec.embed_tokens(tokens.to(positions.device)) * self.embed_scale + positions
        for layer, cache, cross in zip(dec.layers, state.cache, state.cross):
            x = layer.step(x, cache, cross)
        state.length += n
        return F.linear(dec.layer_norm(x[:, -1]), dec.embed_tokens.weight).float()
