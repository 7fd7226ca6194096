"""``llmkit batch run``: CLI plumbing with a fake executor, and the real embedded model end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from contextlib import contextmanager

import typer
from typer.testing import CliRunner

from llmkit.cli.batch import register

from batch_utils import fake_execute, jsonl


def test_batch_run_writes_merged_output_in_input_order(tmp_path, monkeypatch):
    seen_args = []

    @contextmanager
    def batch_executor_for(args):
        seen_args.append(args)
        yield fake_execute

    monkeypatch.setitem(sys.modules, "llmkit.cli.serve", types.SimpleNamespace(batch_executor_for=batch_executor_for))
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(7, lambda i: "fail" if i in (2, 5) else f"q{i}", url="/chat/completions"))
    out = tmp_path / "out.jsonl"
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a group needs two commands to keep the "batch" level
    res = CliRunner().invoke(
        app, ["batch", "run", str(src), "-o", str(out), "--no-progress", "--model-path", "x", "--device", "cpu"]
    )
    assert res.exit_code == 0, res.output
    assert seen_args == [["--model-path", "x", "--device", "cpu"]]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"r-{i}" for i in range(7)]
    assert [x["error"] is not None for x in lines] == [i in (2, 5) for i in range(7)]
    assert "5 succeeded, 2 failed" in res.output


def test_batch_run_reports_validation_errors(tmp_path, monkeypatch):
    @contextmanager
    def batch_executor_for(args):
        yield fake_execute

    monkeypatch.setitem(sys.modules, "llmkit.cli.serve", types.SimpleNamespace(batch_executor_for=batch_executor_for))
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(2) + b"{oops\n")
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["batch", "run", str(src), "-o", str(tmp_path / "o.jsonl"), "--no-progress"])
    assert res.exit_code == 1 and "line 3" in res.output
    # As the online API: the valid lines do not run, and no (empty) output file is left behind.
    assert not (tmp_path / "o.jsonl").exists()


def test_help_does_not_import_torch():
    code = (
        "import sys, typer; from llmkit.cli.batch import register; app = typer.Typer(); register(app);"
        "app.command('noop')(lambda: None)\n"
        "try: app(['batch', 'run', '--help'])\nexcept SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "INPUT.jsonl" in res.stdout


def test_batch_run_with_the_embedded_model(tmp_path):
    """The real thing: `llmkit batch run` loads the embedded model and answers every line."""
    import json
    import subprocess

    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "max_tokens": 6,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Say the number {i}."}],
            },
        }
        for i in range(3)
    ]
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "max_tokens": -5, "messages": [{"role": "user", "content": "x"}]},
        }
    )
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmkit.cli.main",
            "batch",
            "run",
            str(src),
            "-o",
            str(out),
            "--no-progress",
            "--served-model-name",
            "m",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["c0", "c1", "c2", "bad"]
    for r in results[:3]:
        body = r["response"]["body"]
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and isinstance(body["choices"], list)
        assert body["usage"]["completion_tokens"] <= 6
    assert results[3]["response"] is None or results[3]["response"]["status_code"] == 400
