"""Tiny random-weight Gemma 3 checkpoints (text-only and multimodal) with everything a server
needs beside the weights: a tokenizer whose special tokens sit at the config's ids, Gemma 3's chat
template, generation_config.json and the image processor's preprocessor_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
HIDDEN = 64
SLIDING_WINDOW = 8  # shorter than the tests' prompts, longer than one image's 4 soft tokens
IMAGE_SIZE = 28  # 2 x 2 patches of 14, pooled 1:1 to mm_tokens_per_image = 4 rows
MM_TOKENS = 4

# Gemma's specials at Gemma's ids where they are small (pad 0, eos 1, bos 2, unk 3); the rest
# after the 256 byte symbols and three newline merges
PAD, EOS, BOS, UNK = 0, 1, 2, 3
NEWLINES = {"\n\n": 260, "\n\n\n": 261, "\n\n\n\n": 262}
START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE_SOFT = 263, 264, 265, 266, 267
SPECIALS = {
    "<pad>": PAD,
    "<eos>": EOS,
    "<bos>": BOS,
    "<unk>": UNK,
    "<start_of_turn>": START_OF_TURN,
    "<end_of_turn>": END_OF_TURN,
    "<start_of_image>": BOI,
    "<end_of_image>": EOI,
    "<image_soft_token>": IMAGE_SOFT,
}

# Gemma 3's chat template (google/gemma-3-4b-it's tokenizer_config.json): an image part is one
# <start_of_image>, which the processor expands
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


def text_config_kwargs(**overrides) -> dict:
    """Gemma3TextConfig arguments: 3 layers (sliding, sliding, full), a window of 8, linear rope
    scaling on the global layers, local and global rope bases that differ."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,  # not head_dim: the scale must come from here
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=[EOS, END_OF_TURN],
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return kw


def _widen(model) -> None:
    """Random init is tiny (and Gemma's norms start at zero): widen it so logits differ meaningfully."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(0, 0.3)
            else:  # biases (vision tower)
                p.normal_(0, 0.1)


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer of ``VOCAB`` ids: a token for each byte (every text tokenizes),
    merges for runs of 2-4 newlines (as Gemma's vocabulary has, pieces of their own), Gemma 3's special tokens at the
    config's ids, filler words for the rest; the chat template in tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    newline = "\u010a"  # byte-level's symbol for "\n"
    assert newline in symbols
    vocab = {tok: i for tok, i in SPECIALS.items()}
    vocab.update({c: 4 + i for i, c in enumerate(symbols)})
    vocab.update({newline * len(text): i for text, i in NEWLINES.items()})
    taken = set(vocab.values())
    vocab.update({f"t{i}": i for i in range(VOCAB) if i not in taken})
    merges = [(newline, newline), (newline * 2, newline), (newline * 2, newline * 2)]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    # newline runs are pieces of their own whatever follows them, as in Gemma's tokenizer (byte-level's
    # GPT-2 split would leave the last newline of "\n\nx" to the word)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == VOCAB, len(fast)
    assert all(fast.convert_tokens_to_ids(t) == i for t, i in SPECIALS.items())
    fast.save_pretrained(str(path))


def _write_generation_config(path: Path) -> None:
    gen = {"bos_token_id": BOS, "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))


def save_tiny_gemma3_text(path, **overrides):
    """A servable random-weight ``Gemma3ForCausalLM`` (model_type gemma3_text) at ``path``;
    returns the transformers model (fp32, eval)."""
    import transformers

    path = Path(path)
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**text_config_kwargs(**overrides))
    model = transformers.Gemma3ForCausalLM(cfg).to(torch.float32)
    _widen(model)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    write_tokenizer(path)
    _write_generation_config(path)
    return model.eval()


def tiny_config(**text_overrides):
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
        layer_norm_eps=1e-6,
        vision_use_head=False,
    )
    return transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**text_config_kwargs(**text_overrides)),
        vision_config=vision,
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE_SOFT,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=[EOS, END_OF_TURN],
        tie_word_embeddings=True,
    )


def save_tiny_gemma3(path, **text_overrides):
    """A complete servable random-weight ``Gemma3ForConditionalGeneration`` at ``path``: config,
    safetensors, tokenizer (with the chat template), generation_config.json and the image
    processor's preprocessor_config.json (``IMAGE_SIZE`` pixels). Returns the transformers model
    (fp32, eval)."""
    import transformers

    path = Path(path)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(tiny_config(**text_overrides)).to(torch.float32)
    _widen(model)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    write_tokenizer(path)
    _write_generation_config(path)
    image_processor_class().from_dict(
        {"size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_pan_and_scan": False}
    ).save_pretrained(str(path))
    return model.eval()


def image_processor_class():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil


def random_image(seed: int, size: tuple[int, int] = (40, 30)):
    """A random RGB ``PIL.Image`` (not square, not the model's size: the processor resizes it)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")
