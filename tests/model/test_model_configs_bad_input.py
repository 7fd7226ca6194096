"""A checkpoint whose config.json names a variant the new model families do not support fails at
start-up with one line naming the field and what is supported, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from model_utils import copy_embedded_tokenizer, save_tiny_model
from server_utils import free_port


def _serve_fails(model_dir) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "serve", "--model-path", str(model_dir), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    ("arch", "change", "drop", "expected"),
    [
        ("deepseek_v3", {}, "kv_lora_rank", "kv_lora_rank is missing"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "gptq"}}, None, "quant_method 'gptq'"),
        ("gpt_oss", {"quantization_config": {"quant_method": "bitsandbytes"}}, None, "supported: mxfp4"),
        ("qwen3_moe", {}, "moe_intermediate_size", "moe_intermediate_size is missing"),
    ],
)
def test_unsupported_variant_fails_at_start_up_naming_the_field(tmp_path, arch, change, drop, expected):
    save_tiny_model(arch, tmp_path)
    copy_embedded_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    cfg.pop(drop, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert expected in _serve_fails(tmp_path)


def test_checkpoint_missing_an_expert_fails_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model("qwen3_moe", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v for k, v in tensors.items() if "experts.3.down_proj" not in k}, str(f))
    err = _serve_fails(tmp_path)
    assert "does not fit Qwen3MoeForCausalLM" in err and "experts.3.down_proj.weight" in err
