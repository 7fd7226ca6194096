"""``llmkit batch run INPUT.jsonl -o OUTPUT.jsonl [serve options]``: a batch file without a server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmkit.cli.help_format import FlagCommand, FlagGroup

batch_app = typer.Typer(name="batch", help="Run OpenAI batch files offline.", no_args_is_help=True, cls=FlagGroup)

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@batch_app.command("run", context_settings=_PASS_THROUGH, cls=FlagCommand)
def run(
    ctx: typer.Context,
    input_path: Annotated[
        Path,
        typer.Argument(
            metavar="INPUT.jsonl", exists=True, dir_okay=False, help="OpenAI batch input: one request per line."
        ),
    ],
    *,
    output: Annotated[
        Path, typer.Option("-o", "--output", dir_okay=False, help="Where to write one result line per request.")
    ],
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", help="/v1/chat/completions or /v1/completions (default: the first line's url)."),
    ] = None,
    max_in_flight: Annotated[
        int,
        typer.Option(
            "--max-in-flight", envvar="LLMKIT_BATCH_MAX_IN_FLIGHT", min=1, help="Requests handed to the engine at once."
        ),
    ] = 64,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
) -> None:
    """Run every request of INPUT.jsonl on the model and write the results to OUTPUT.

    Any other option (--model-path, --device, --attention, ...) is one of `llmkit serve`'s. The
    requests go through the same endpoint code as the server's, and OUTPUT holds one line per
    request in input order, each with a `response` or an `error`.
    """
    import asyncio

    from tqdm import tqdm

    from llmkit.core.batches.offline import run_batch_file

    try:
        from llmkit.cli.serve import batch_executor_for  # imports torch: only when running
    except ImportError as exc:
        raise typer.BadParameter(f"the serve command is not available: {exc}") from exc

    bar = tqdm(total=0, unit="req", disable=not progress, desc="batch")

    def on_progress(rec) -> None:
        counts = rec.request_counts
        bar.total = counts["total"]
        bar.n = counts["completed"] + counts["failed"]
        bar.set_postfix(failed=counts["failed"], refresh=False)
        bar.refresh()

    from llmkit.core.plugins import PluginError

    try:
        with batch_executor_for(list(ctx.args)) as execute:
            rec = asyncio.run(
                run_batch_file(
                    input_path, output, execute, endpoint=endpoint, max_in_flight=max_in_flight, on_progress=on_progress
                )
            )
    except (PluginError, FileNotFoundError, ValueError) as exc:  # a serve option is wrong
        bar.close()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    bar.close()
    counts = rec.request_counts
    if rec.status == "failed":
        for err in rec.errors or []:
            where = f"line {err['line']}: " if err.get("line") else ""
            typer.echo(f"{where}{err['message']} ({err['code']})", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"{rec.status}: {counts['completed']} succeeded, {counts['failed']} failed -> {output}")


def register(app: typer.Typer) -> None:
    """Add ``llmkit batch ...`` to the main CLI."""
    app.add_typer(batch_app, name="batch")
