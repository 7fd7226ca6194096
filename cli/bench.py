"""``llmkit bench serve``: load-test any OpenAI-compatible server (llmkit, vLLM, SGLang, llama-server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmkit.cli.help_format import FlagCommand, FlagGroup

bench_app = typer.Typer(name="bench", help="Benchmarks.", no_args_is_help=True, cls=FlagGroup)
BACKENDS = ("openai-chat", "openai-completions")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app)


def _rate(value: str) -> float:
    if value.lower() == "inf":
        return float("inf")
    rate = float(value)
    if not rate > 0:
        raise typer.BadParameter("must be > 0 or 'inf'")
    return rate


@bench_app.command("serve", cls=FlagCommand)
def serve(
    *,
    base_url: Annotated[
        str, typer.Option("--base-url", envvar="LLMKIT_BENCH_BASE_URL", help="The server's root URL (without /v1).")
    ] = "http://127.0.0.1:30000",
    model: Annotated[
        Optional[str], typer.Option("--model", help="Model id to request (default: the first of /v1/models).")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help="openai-chat or openai-completions.")] = "openai-chat",
    dataset_path: Annotated[
        Optional[Path],
        typer.Option(
            "--dataset-path",
            exists=True,
            dir_okay=False,
            help='JSONL of {"prompt": ...} or {"messages": [...]} (optional "max_tokens"); default: random prompts.',
        ),
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, help="Requests to send.")] = 100,
    random_input_len: Annotated[
        int, typer.Option("--random-input-len", min=1, help="Words per random prompt (about one token each).")
    ] = 256,
    random_output_len: Annotated[
        int,
        typer.Option("--random-output-len", min=1, help="max_tokens of each request (JSONL lines may set their own)."),
    ] = 128,
    request_rate: Annotated[
        str, typer.Option("--request-rate", help="Requests per second (Poisson arrivals), or inf to send all at once.")
    ] = "inf",
    max_concurrency: Annotated[
        Optional[int], typer.Option("--max-concurrency", min=1, help="Most requests in flight at once.")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Generate max_tokens whatever the model says.")
    ] = False,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="OPENAI_API_KEY")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", dir_okay=False, help="Write the results as JSON here.")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Send a workload to an OpenAI-compatible server and report throughput and latencies
    (TTFT, TPOT, ITL, end-to-end: mean, median, p90, p99)."""
    from llmkit.cli.bench_serve import format_summary, jsonl_prompts, random_prompts, run_bench

    if backend not in BACKENDS:
        raise typer.BadParameter(f"choose one of {', '.join(BACKENDS)}", param_hint="--backend")
    rate = _rate(request_rate)
    try:
        prompts = (
            jsonl_prompts(dataset_path, num_prompts, random_output_len)
            if dataset_path
            else random_prompts(num_prompts, random_input_len, random_output_len, seed)
        )
        if backend == "openai-completions" and any(p.text is None for p in prompts):
            raise ValueError("--backend openai-completions needs JSONL lines with a 'prompt' field")
        summary = run_bench(
            base_url=base_url,
            model=model,
            backend=backend,
            prompts=prompts,
            request_rate=rate,
            max_concurrency=max_concurrency,
            ignore_eos=ignore_eos,
            api_key=api_key,
            seed=seed,
            progress=progress,
        )
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except Exception as exc:  # the server is unreachable or /v1/models failed
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(format_summary(summary))
    if json_path is not None:
        json_path.write_text(json.dumps(summary, indent=2) + "\n")
