"""A tree draft's verify step through the real model runner, on the torch backend and on the Triton
kernels (Triton's interpreter, in a process of its own): every node's logits equal transformers'
over the node's own path (the prompt, the root, its ancestors, itself), with page sizes that split
the tree's slots over pages, and a plain decode row of another sequence in the same step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmkit.core.engine.model_runner import ModelRunner
from llmkit.core.engine.scheduling.scheduled_batch import ScheduledBatch, Segment
from llmkit.core.speculative.tree import DraftTree

from paged_runner import PagedRunner

PROMPT = [(7 * i + 3) % 500 + 3 for i in range(21)]  # its last token is the tree's root
OTHER = [(11 * i + 5) % 500 + 3 for i in range(9)]
TOKENS = (40, 41, 42, 50, 51, 43, 60)  # a main chain 40-41-42, a branch 50-51 off the root, ...
PARENTS = (-1, 0, 1, -1, 3, 0, 4)  # ... 43 off 40, and 60 under 51


def _req(row: int, ids: list[int]):
    return SimpleNamespace(
        req_pool_idx=row,
        prompt_ids=ids,
        output_ids=[],
        inflight=False,
        mm=None,
        lora=None,
        needs_prompt_logits=False,
        seq_len=len(ids),
        token_slice=lambda a, b: ids[a:b],
    )


def tree_scenario(model_dir, page_size: int, kernels: str = "torch") -> list[list[float]]:
    """The logits of the tree step's rows (the root's, then each node's) and the other row's."""
    from model_utils import load_ours

    cls = None
    if kernels == "triton":
        from llmkit.plugins.attention.triton_backend import TritonAttentionBackend as cls
    paged = PagedRunner(load_ours(Path(model_dir)), page_size, backend_cls=cls)
    a, b = paged.new_seq(), paged.new_seq()
    paged.step([(a, PROMPT[:-1]), (b, OTHER[:-1])])  # the prompts up to their last tokens
    runner = ModelRunner(paged.model, paged.attn, paged.pool, paged.req_pool, torch.device("cpu"), False)
    paged._grow(a, 1 + len(TOKENS))  # the chain layout's slots: the root, then node i at + 1 + i
    paged._grow(b, 1)
    tree = Segment(_req(a, PROMPT), len(PROMPT) - 1, 1 + len(TOKENS), list(TOKENS), DraftTree(TOKENS, PARENTS))
    plain = Segment(_req(b, OTHER), len(OTHER) - 1, 1)
    inp = runner.step_inputs(ScheduledBatch([plain, tree]))
    logits, _ = runner.execute(inp)
    return logits.tolist()


def _interpreted(model_dir, page_size: int, out: Path) -> list:
    code = (
        f"import sys, json; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1] / 'helpers')]!r}; "
        "import test_tree_attention as t; "
        "json.dump(t.tree_scenario(sys.argv[1], int(sys.argv[2]), 'triton'), open(sys.argv[3], 'w'))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "LLMKIT_TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(page_size), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _reference(model_dir) -> torch.Tensor:
    """transformers' next-token logits at the other sequence's end, the root, and each node."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def last(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    rows = [last(OTHER), last(PROMPT)]
    for i in range(len(TOKENS)):
        path, node = [], i
        while node >= 0:
            path.append(TOKENS[node])
            node = PARENTS[node]
        rows.append(last(PROMPT + path[::-1]))
    return torch.stack(rows)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_every_node_sees_exactly_its_path(tiny_llama, tmp_path, kernels, page_size):
    if kernels == "torch":
        got = tree_scenario(tiny_llama, page_size)
    else:
        pytest.importorskip("triton")
        got = _interpreted(tiny_llama, page_size, tmp_path / "logits.json")
    want = _reference(tiny_llama)
    got = torch.tensor(got)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
