"""A tiny, servable Qwen2.5-VL model directory and the per-forward image rows the engine builds."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch

from llmkit.core.multimodal.forward import MultimodalForward
from llmkit.core.multimodal.items import MultimodalInputs, pseudo_id

# Qwen2.5-VL's special tokens, at the top of the tiny 512-id vocabulary (bytes take 0..255)
SPECIAL = {
    "<|endoftext|>": 500,
    "<|im_start|>": 501,
    "<|im_end|>": 502,
    "<|vision_start|>": 503,
    "<|vision_end|>": 504,
    "<|vision_pad|>": 505,
    "<|image_pad|>": 506,
    "<|video_pad|>": 507,
}
VOCAB_SIZE = 512
IMAGE_TOKEN_ID = SPECIAL["<|image_pad|>"]

# Qwen2.5-VL's chat template (chat_template.json of the released checkpoints)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def png_b64(im) -> str:
    """A ``PIL.Image`` as base64 PNG bytes (Anthropic's bare base64 sources)."""
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def data_url(im) -> str:
    """A ``PIL.Image`` as a PNG ``data:`` URL (an OpenAI ``image_url``)."""
    return "data:image/png;base64," + png_b64(im)


def tiny_qwen2_5_vl_config():
    from transformers import Qwen2_5_VLConfig

    ids = dict(bos_token_id=SPECIAL["<|endoftext|>"], eos_token_id=SPECIAL["<|im_end|>"])
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # head_dim 16: 8 frequencies, 2 temporal, 3 height, 3 width
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3]),
        **ids,
    )
    # window 56 px = 2x2 merged cells: the test images span several windows; block 2 attends fully
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[2],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=SPECIAL["<|video_pad|>"],
        vision_start_token_id=SPECIAL["<|vision_start|>"],
        vision_end_token_id=SPECIAL["<|vision_end|>"],
        tie_word_embeddings=False,
        **ids,
    )


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary holds)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_tokenizer(path) -> None:
    """A byte-level BPE tokenizer of exactly ``VOCAB_SIZE`` ids (every text encodes, every id
    decodes) with Qwen2.5-VL's special tokens at :data:`SPECIAL` and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_byte_symbols())}
    vocab.update({f"t{i}": i for i in range(256, VOCAB_SIZE) if i not in SPECIAL.values()})
    vocab.update(SPECIAL)
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=list(SPECIAL),
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == VOCAB_SIZE, len(fast)
    fast.save_pretrained(str(path))


def save_tiny_qwen2_5_vl(path):
    """A complete servable Qwen2.5-VL directory at ``path`` (random weights, widened as
    ``save_tiny_model`` does): config.json, safetensors, tokenizer with the chat template,
    generation_config.json and preprocessor_config.json (at most 64 merged tokens per image).
    Returns transformers' model (fp32, eval) on the same weights."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config())
    return _save_servable(model, path, patch=14)


def tiny_qwen3_vl_config():
    from transformers import Qwen3VLConfig

    ids = dict(bos_token_id=SPECIAL["<|endoftext|>"], eos_token_id=SPECIAL["<|im_end|>"])
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="default", rope_theta=5000000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
        ),
        **ids,
    )
    # a 6x6 learned position table resampled to every grid; DeepStack from blocks 0 and 1
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=36,
        deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=SPECIAL["<|video_pad|>"],
        vision_start_token_id=SPECIAL["<|vision_start|>"],
        vision_end_token_id=SPECIAL["<|vision_end|>"],
        tie_word_embeddings=False,
        **ids,
    )


def save_tiny_qwen3_vl(path):
    """As :func:`save_tiny_qwen2_5_vl`, a Qwen3-VL (16-pixel patches)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config())
    return _save_servable(model, path, patch=16)


def tiny_qwen3_5_vl_config(moe: bool = False):
    """Qwen3.5 (``moe``: Qwen3.5-MoE) image-text: layers 0-2 Gated DeltaNet, 3 gated attention
    rotating a quarter of each head (16 of 64 channels) by interleaved M-RoPE; Qwen3-VL's tower
    without DeepStack."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    ids = dict(bos_token_id=SPECIAL["<|endoftext|>"], eos_token_id=SPECIAL["<|im_end|>"])
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # 8 frequencies (as 32 of 256): t h w t h w t h, as [11, 11, 10] lays out the real ones
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000000.0,
            partial_rotary_factor=0.25,
            mrope_section=[3, 3, 2],
            mrope_interleaved=True,
        ),
        **ids,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=36,
    )
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=SPECIAL["<|video_pad|>"],
        vision_start_token_id=SPECIAL["<|vision_start|>"],
        vision_end_token_id=SPECIAL["<|vision_end|>"],
        tie_word_embeddings=False,
        **ids,
    )


def save_tiny_qwen3_5_vl(path, moe: bool = False):
    """As :func:`save_tiny_qwen2_5_vl`, a Qwen3.5 (``moe``: Qwen3.5-MoE) image-text model."""
    import transformers

    torch.manual_seed(0)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    return _save_servable(cls(tiny_qwen3_5_vl_config(moe)), path, patch=16)


def _save_servable(model, path, patch: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1) if name.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    gen = dict(bos_token_id=SPECIAL["<|endoftext|>"], eos_token_id=[SPECIAL["<|im_end|>"], SPECIAL["<|endoftext|>"]])
    gen.update(pad_token_id=SPECIAL["<|endoftext|>"])
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer(path)
    unit = patch * 2  # one merged token
    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, min_pixels=unit * unit * 4, max_pixels=unit * unit * 64
    ).save_pretrained(str(path))
    return model.eval()


def mm_rows(inputs: MultimodalInputs, embeds: torch.Tensor, start: int, n: int) -> MultimodalForward | None:
    """``ctx.mm`` for a forward over positions ``start .. start + n`` of one sequence whose prompt
    is described by ``inputs`` (``embeds``: every image's encoder rows, concatenated), as the engine
    builds it: image rows take their encoder rows, positions past the prompt rotate by
    ``p + rope_delta`` on all three axes. None when the prompt has no image."""
    if inputs.rope_positions is None:
        return None
    prompt_len = len(inputs.rope_positions[0])
    first = [0]
    for _, length in inputs.spans:
        first.append(first[-1] + length)
    mask = torch.zeros(n, dtype=torch.bool)
    rows = []
    for j, p in enumerate(range(start, start + n)):
        i = inputs.image_at(p) if p < prompt_len else None
        if i is not None:
            mask[j] = True
            rows.append(first[i] + p - inputs.spans[i][0])
    rope = torch.empty(3, n, dtype=torch.int64)
    for j, p in enumerate(range(start, start + n)):
        for a in range(3):
            rope[a, j] = inputs.rope_positions[a][p] if p < prompt_len else p + inputs.rope_delta
    return MultimodalForward(mask=mask, embeds=embeds[torch.tensor(rows, dtype=torch.long)], rope_positions=rope)


# --- comparing with transformers (``vl``: the tests' dict of ref, tok, proc, images) ----------


def random_image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


def grid_of(items) -> torch.Tensor:
    return torch.tensor([item.meta["grid_thw"] for item in items])


def chat_prompt(vl, n_images: int, first: int = 0) -> tuple[list[int], MultimodalInputs, list]:
    """A chat prompt with ``n_images`` of ``vl["images"]`` (from ``first``), expanded by the
    processor: its ids, the MultimodalInputs and the items."""
    content = []
    for i in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": f"picture {i}, "}]
    content.append({"type": "text", "text": "what differs?"})
    text = vl["tok"].apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = vl["tok"](text, add_special_tokens=False)["input_ids"]
    items = [vl["proc"].preprocess(im) for im in vl["images"][first : first + n_images]]
    full, inputs = vl["proc"].expand(ids, items)
    return full, inputs, items


def reference_logits(vl, ids: list[int], items) -> torch.Tensor:
    """transformers' logits over the whole of ``ids`` with its images."""
    t = torch.tensor([ids])
    kw = {}
    if items:
        kw = dict(
            pixel_values=torch.cat([item.pixel_values for item in items]),
            image_grid_thw=grid_of(items),
            mm_token_type_ids=(t == IMAGE_TOKEN_ID).int(),
        )
    with torch.no_grad():
        return vl["ref"](input_ids=t, **kw).logits[0]


def engine_ids(ids: list[int], inputs: MultimodalInputs) -> list[int]:
    """The prompt as the engine holds it: image tokens replaced by their image's pseudo-id."""
    out = list(ids)
    for item, (off, n) in zip(inputs.items, inputs.spans):
        out[off : off + n] = [pseudo_id(item.digest)] * n
    return out


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Equal within 1e-4 of the logits' scale."""
    assert ours.shape == theirs.shape, what
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"{what}: max error {err} at logit scale {scale}"


def load_vl(path, save, sizes: list[tuple[int, int]]) -> dict:
    """``save(path)`` (a ``save_tiny_*`` function), then our model on it, its processor, the
    tokenizer and random images of ``sizes`` (height, width): the dict the helpers above read."""
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import load_config

    from model_utils import load_ours

    ref = save(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = load_ours(path)
    proc = type(model).processor(str(path), load_config(path), tok)
    images = [random_image(h, w, i) for i, (h, w) in enumerate(sizes)]
    return dict(path=path, ref=ref, tok=tok, model=model, proc=proc, images=images)
