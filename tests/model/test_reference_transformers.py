"""Our model code against transformers: logits of tiny random Llama/Qwen2/Qwen3 models, and
greedy text of the embedded model against transformers' ``generate`` on the same weights."""

from __future__ import annotations

import threading

import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import AttentionMetadata
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.loader.source import iter_safetensors, load_config, resolve_model_dir
from llmkit.core.plugins import registry
from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

import model_utils
from model_utils import save_tiny_model, start_engine


def _prefill_logits(
    model, ids: list[int], device: torch.device | None = None, lora=None, backend=TorchAttentionBackend
) -> torch.Tensor:
    """Run our model over ``ids`` as one prefill through the paged KV path (on ``device``, the CPU
    by default, the pool in the model's dtype); fp32 logits for every position, on the CPU.
    ``lora``: the LoRA batch of an active adapter (tests/lora); ``backend``: the attention
    backend's class."""
    n, device = len(ids), device or torch.device("cpu")
    pool = KVCachePool(
        num_layers=model.num_layers,
        num_pages=n + 2,
        page_size=1,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=next(model.parameters()).dtype,
        device=device,
    )
    req_pool = ReqToTokenPool(2, n + 1, device)
    slots = pool.page_slots(pool.allocate(n)).to(device)
    req_pool.table[0, :n] = slots
    md = AttentionMetadata(
        num_seqs=1,
        q_lens=[n],
        kv_lens=[n],
        q_start_loc=torch.tensor([0, n], device=device),
        q_lens_t=torch.tensor([n], device=device),
        kv_lens_t=torch.tensor([n], device=device),
        req_pool_indices=torch.tensor([0], device=device),
        req_to_token=req_pool.table,
        out_slots=slots,
        page_size=1,
        is_decode=False,
    )
    attn = backend(
        num_heads=model.config["num_attention_heads"],
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        pool=pool,
        device=device,
    )
    md = attn.prepare_metadata(md)
    with torch.inference_mode():
        ctx = ForwardContext(attn, md, lora)
        hidden = model(torch.tensor(ids, device=device), torch.arange(n, device=device), ctx)
        return model.compute_logits(hidden).float().cpu()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_logits_match_transformers(arch, tmp_path):
    ref = save_tiny_model(arch, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded
    config = load_config(tmp_path)
    cls = registry().model(config["architectures"][0])
    model = build_model(cls, config, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(tmp_path))
    ids = [3, 17, 99, 250, 7, 401, 12, 5, 300, 42, 8, 1]
    ours = _prefill_logits(model, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


PROMPTS = [
    "What is the capital of France?",
    "List 3 countries and their capitals.",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
]


@pytest.fixture(scope="module")
def embedded_reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return tok, model


def _ours(engine, ids: list[int], n: int) -> list[int]:
    done, out = threading.Event(), []

    def sink(o):
        out.extend(o.token_ids)
        if o.finished:
            done.set()

    engine.submit(
        GenerateRequest(
            f"ref-{len(ids)}-{ids[-3:]}", ids, SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
        ),
        sink,
    )
    assert done.wait(120)
    return out


def test_greedy_matches_transformers_generate(embedded_reference):
    """32 greedy tokens per prompt (EOS banned on both sides, as min_new_tokens does) equal transformers' greedy generate; wherever the two pick
    different tokens, the reference's top-2 logits at that step are a numerical tie."""
    tok, ref = embedded_reference
    engine = start_engine(quantization="none")  # the GGUF dequantized: the weights transformers runs
    try:
        for text in PROMPTS:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ours = _ours(engine, ids, 32)
            with torch.no_grad():
                gen = ref.generate(
                    torch.tensor([ids]),
                    max_new_tokens=32,
                    min_new_tokens=32,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
            theirs = gen.sequences[0, len(ids) :].tolist()
            if ours == theirs:
                continue
            k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            top2 = torch.topk(gen.scores[k][0], 2).values
            assert (top2[0] - top2[1]).item() < 1e-3, (
                f"diverged at step {k} for {text!r} without a tie: {tok.decode(ours)!r} vs {tok.decode(theirs)!r}"
            )
    finally:
        engine.shutdown()


def test_gguf_path_and_embedded_default_resolve_to_the_same_conversion():
    from llmkit.core.model.loader.source import embedded_gguf_path

    converted = resolve_model_dir(None)
    assert resolve_model_dir(str(embedded_gguf_path())) == converted
    assert (converted / "config.json").exists() and (converted / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError, match="cannot be downloaded"):
        resolve_model_dir("meta-llama/Meta-Llama-3.1-8B-Instruct")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_real_shape_config_features_match_transformers(arch, tmp_path):
    """What benchmarks/bench_gpu.py's real-shape configs use: tied embeddings (Qwen2.5-0.5B) and
    Llama-3.1's "llama3" rope scaling, with original_max_position_embeddings shrunk to 32 so the
    scaled frequencies matter within a short prompt."""
    import transformers

    torch.manual_seed(0)
    kw = model_utils.tiny_config(arch).to_dict()
    kw.update(tie_word_embeddings=True)
    if arch == "llama":
        kw.pop("rope_parameters", None)
        kw.update(
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        )
    cfg = type(model_utils.tiny_config(arch))(**kw)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    config = load_config(tmp_path)
    model = build_model(registry().model(config["architectures"][0]), config, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(tmp_path))
    assert model.lm_head.tied is model.embed_tokens  # tied: logits come from the embedding matrix
    ids = [(37 * i + 11) % 512 for i in range(48)]
    ours = _prefill_logits(model, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_llama31_rope_frequencies_match_transformers():
    """Llama-3.1-8B's rope settings exactly as its config.json spells them."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmkit.core.model.layers import _inv_freq

    scaling = dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192, rope_type="llama3"
    )
    raw = dict(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**raw), "cpu")
    assert scale == 1.0
    assert torch.allclose(_inv_freq(128, raw).float(), theirs.float(), rtol=1e-6, atol=0)
