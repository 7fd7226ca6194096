"""``--speculative-algorithm EAGLE3``: EAGLE-3's draft head over the target's hidden states.

- The head's drafts equal a from-scratch computation written out here (no K/V cache, its own
  norms, rotary and attention), across proposals whose drafts were partly rejected, so the cache
  cut and the features fed after an accepted run are right.
- Served, a random head leaves the output token-for-token unchanged (greedy and seeded); a head and
  a target that agree on every token keep every draft.
- A head that does not fit is refused at start-up with the reason.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from spec_utils import PROMPTS, serve_prompts, tp2_and_one_rank, walk_proposals

from model_utils import copy_embedded_tokenizer, save_tiny_model, start_engine

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128
TARGET_VOCAB, DRAFT_VOCAB, THETA, EPS = 512, 256, 10000.0, 1e-6
AUX = [0, 1, 3]  # layer outputs: the inputs of layers 1 and 2, and the last layer's output (4 layers)


def head_tensors(seed: int = 0, zero_lm_head: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    t = {
        "fc.weight": w(HIDDEN, 3 * HIDDEN),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": w(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": w(HIDDEN, INTER),
        "midlayer.input_layernorm.weight": 1 + w(HIDDEN),
        "midlayer.hidden_norm.weight": 1 + w(HIDDEN),
        "midlayer.post_attention_layernorm.weight": 1 + w(HIDDEN),
        "norm.weight": 1 + w(HIDDEN),
        "lm_head.weight": torch.zeros(DRAFT_VOCAB, HIDDEN) if zero_lm_head else w(DRAFT_VOCAB, HIDDEN),
    }
    # the draft vocabulary: a sorted subset of the target's, as d2t offsets (draft 0 -> target 0)
    chosen = torch.cat(
        (
            torch.zeros(1, dtype=torch.long),
            1 + torch.randperm(TARGET_VOCAB - 1, generator=g)[: DRAFT_VOCAB - 1].sort().values,
        )
    )
    t["d2t"] = chosen - torch.arange(DRAFT_VOCAB)
    t["t2d"] = torch.zeros(TARGET_VOCAB, dtype=torch.bool).index_fill_(0, chosen, True)
    return t


def save_head(path, tensors: dict[str, torch.Tensor], **config_overrides) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "vocab_size": TARGET_VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX},
        **config_overrides,
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    target = tmp_path_factory.mktemp("target")
    save_tiny_model("llama", target, num_hidden_layers=4)
    copy_embedded_tokenizer(target)
    head = tmp_path_factory.mktemp("head")
    save_head(head, head_tensors())
    # a target that always says token 0 (its final norm zeroed: every logit 0), and a head that
    # always drafts draft id 0 (= target id 0): they agree on every token
    constant = tmp_path_factory.mktemp("constant-target")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(constant)
    copy_embedded_tokenizer(constant)
    agreeing = tmp_path_factory.mktemp("agreeing-head")
    save_head(agreeing, head_tensors(zero_lm_head=True))
    return SimpleNamespace(target=target, head=head, constant=constant, agreeing=agreeing)


# -- the head against a from-scratch computation ----------------------------------------------


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, positions):
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ang = positions[:, None].double() * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_head(t, embed, hidden_in, tokens, positions):
    """All rows at once, causal attention over every earlier row: the head's outputs and its
    predicted target ids. ``hidden_in`` rows are features (3H) or the head's own outputs (H)."""
    hidden = torch.stack([h @ t["fc.weight"].T if h.shape[-1] == 3 * HIDDEN else h for h in hidden_in])
    x = torch.cat(
        (_rms(embed[tokens], t["midlayer.input_layernorm.weight"]), _rms(hidden, t["midlayer.hidden_norm.weight"])), -1
    )
    n = len(tokens)
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ t["midlayer.self_attn.o_proj.weight"].T
    mid = attn + hidden
    h = _rms(mid, t["midlayer.post_attention_layernorm.weight"])
    mlp = (
        torch.nn.functional.silu(h @ t["midlayer.mlp.gate_proj.weight"].T) * (h @ t["midlayer.mlp.up_proj.weight"].T)
    ) @ t["midlayer.mlp.down_proj.weight"].T
    out = mlp + mid
    best = (_rms(out, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return out, best + t["d2t"][best]


def reference_drafts(t, embed, feats: dict, ids: list[int], first: int, n: int, k: int) -> list[int]:
    """The k draft tokens after ``ids`` (positions [first, n) have features), recomputed whole."""
    hidden_in = [feats[p] for p in range(first, n)]
    tokens = list(ids[first + 1 : n + 1])
    positions = list(range(first, n))
    drafts = []
    for step in range(k):
        out, best = reference_head(t, embed, hidden_in, torch.tensor(tokens), torch.tensor(positions))
        drafts.append(int(best[-1]))
        hidden_in.append(out[-1])
        tokens.append(drafts[-1])
        positions.append(n + step)
    return drafts


def test_the_heads_drafts_equal_a_from_scratch_computation(models):
    from llmkit.plugins.speculative.eagle3 import Eagle3Proposer

    from model_utils import load_ours

    target = load_ours(models.target)
    proposer = Eagle3Proposer(draft_model_path=str(models.head), target_vocab_size=TARGET_VOCAB, target_model=target)
    assert proposer.feature_layers == (1, 2, 4)
    t = head_tensors()
    embed = target.embed_tokens.weight.detach()
    # a prompt of 7 tokens whose first 3 came from the prefix cache (no states before position 3)
    walk_proposals(
        proposer,
        lambda states, ids, first, n, k: reference_drafts(t, embed, states, ids, first, n, k),
        3 * HIDDEN, TARGET_VOCAB, first=3,
    )  # fmt: skip


# -- served --------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [1, 3])
def test_a_random_head_leaves_the_output_unchanged(models, topk):
    reference, _ = serve_prompts(models.target)
    got, stats = serve_prompts(
        models.target,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(models.head),
        speculative_num_draft_tokens=3 * topk,
        speculative_eagle_topk=topk,
    )
    assert got == reference  # greedy and seeded alike, a chain or a tree (its own vocabulary: d2t)
    assert stats.verify_steps > 0 and stats.draft_tokens > 0


def test_a_head_that_agrees_with_the_target_keeps_every_draft(models):
    reference, _ = serve_prompts(models.constant)
    got, stats = serve_prompts(
        models.constant,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(models.agreeing),
        speculative_num_draft_tokens=4,
    )
    assert got == reference
    assert reference[(0, 0)] == [0] * 24
    # the greedy rows keep every draft; the seeded rows sample from the target's flat
    # distribution and keep almost none
    assert stats.accepted_tokens >= 3 * 16 and stats.accept_length > 1.5


@pytest.mark.slow  # a server of two rank processes
def test_under_tp2_rank_0_drafts_through_the_gathered_embedding(models):
    """``--tp-size 2``: the head ships no embedding, the target's is split over the ranks, and only
    rank 0 drafts, on its gathered copy (the copy itself: test_target_vocab.py). The agreeing
    head's drafts are kept as on one rank, and the output is one rank's, greedy and seeded."""
    spec = dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=str(models.agreeing),
        speculative_num_draft_tokens=4,
    )  # fmt: skip
    (got, accepted), (reference, stats) = tp2_and_one_rank(models.constant, **spec)
    assert got == reference and reference[(0, 0)] == [0] * 24
    assert accepted == stats.accepted_tokens >= 3 * 16


def test_a_head_that_does_not_fit_is_refused(models, tmp_path):
    target = str(models.target)
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        start_engine(model_path=target, speculative_algorithm="EAGLE3")
    with pytest.raises(ValueError, match="no config.json"):
        start_engine(model_path=target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    cases = {
        "missing": ({k: v for k, v in head_tensors().items() if k != "fc.weight"}, {}, "missing fc.weight"),
        "shape": ({**head_tensors(), "fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}, {}, "fc.weight is"),
        "layers": (head_tensors(), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "layers"),
        "d2t": ({**head_tensors(), "d2t": torch.full((DRAFT_VOCAB,), TARGET_VOCAB)}, {}, "past the target"),
        "foreign": ({**head_tensors(), "layers.0.mlp.weight": torch.zeros(2)}, {}, "unexpected tensor"),
    }
    for name, (tensors, config, message) in cases.items():
        save_head(tmp_path / name, tensors, **config)
        with pytest.raises(ValueError, match=message):
            start_engine(
                model_path=target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / name)
            )


def test_served_through_the_openai_client(models):
    """The server with an EAGLE-3 head answers what the plain server answers: streamed and not,
    with logprobs; its drafts are counted in /metrics."""
    import httpx
    import openai

    from server_utils import start_server, stop_server

    prompt = PROMPTS[0]
    common = ["--model-path", str(models.target), "--batch-storage", "none", "--num-threads", "1"]

    def answers(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(model="m", prompt=prompt, max_tokens=20, temperature=0, logprobs=2)
        whole = client.completions.create(**kw).choices[0]
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return whole.text, streamed, whole.logprobs.tokens, [round(x, 4) for x in whole.logprobs.token_logprobs]

    proc, url = start_server(common)
    try:
        plain = answers(url)
    finally:
        stop_server(proc)
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(models.head)]
    proc, url = start_server([*common, *spec])
    try:
        text, streamed, tokens, logprobs = answers(url)
        assert (text, tokens, logprobs) == (plain[0], plain[2], plain[3])
        assert streamed == text == plain[1]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        drafts = [line for line in metrics.splitlines() if line.startswith("llmkit:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0
    finally:
        stop_server(proc)
