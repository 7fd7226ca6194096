"""``llmkit serve``: load a model and serve the OpenAI API."""

from __future__ import annotations

import contextlib
import logging
from typing import Annotated, Optional

import typer

from llmkit.cli.options import (Attention, ChatTemplate, ChunkedPrefill, ContextLength, CudaGraphMaxBs,
                                Deterministic, Device, DisableCudaGraph, DisableOverlap, DisableRadix, Dtype,
                                EnableOverlap, GrammarBackend, LoadFormat, MaxRunning, MaxTotalTokens, ModelPath,
                                PageSize, Quantization, ReasoningParser, SchedulePolicy, Threads, ToolCallParser)
from llmkit.cli.options import MemFractionStatic, ServedModelName, TpSize, TrustRemoteCode


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    model_path: ModelPath = None,
    host: Annotated[str, typer.Option("--host", envvar="LLMKIT_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="LLMKIT_PORT")] = 30000,
    served_model_name: ServedModelName = None,
    chat_template: ChatTemplate = None,
    attention: Attention = "auto",
    reasoning_parser: ReasoningParser = None,
    tool_call_parser: ToolCallParser = None,
    grammar_backend: GrammarBackend = "xgrammar",
    dtype: Dtype = "auto",
    device: Device = "auto",
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LLMKIT_API_KEY",
                       help="Require 'Authorization: Bearer KEY' (except /health*).")] = None,
    context_length: ContextLength = None,
    max_running_requests: MaxRunning = 64,
    max_queued_requests: Annotated[int, typer.Option("--max-queued-requests",
                                   help="Requests held at once; beyond this new ones get 429.")] = 1024,
    max_total_tokens: MaxTotalTokens = None,
    chunked_prefill_size: ChunkedPrefill = 2048,
    schedule_policy: SchedulePolicy = "fcfs",
    disable_radix_cache: DisableRadix = False,
    page_size: PageSize = 1,
    enable_deterministic_inference: Deterministic = False,
    num_threads: Threads = None,
    quantization: Quantization = None,
    cuda_graph_max_bs: CudaGraphMaxBs = None,
    disable_cuda_graph: DisableCudaGraph = False,
    disable_overlap_schedule: DisableOverlap = False,
    enable_overlap_schedule: EnableOverlap = False,
    load_format: LoadFormat = "auto",
    max_payload_size: Annotated[int, typer.Option("--max-payload-size", help="Request body cap in bytes.")] = 32 << 20,
    shutdown_timeout: Annotated[int, typer.Option("--shutdown-timeout",
                                help="Seconds to drain in-flight requests after SIGTERM.")] = 30,
    batch_storage: Annotated[str, typer.Option("--batch-storage", envvar="LLMKIT_BATCH_STORAGE",
                             help="Storage backend for /v1/files and /v1/batches: local, s3, or a plugin's; "
                                  "'none' disables the endpoints.")] = "local",
    file_storage_path: Annotated[str, typer.Option("--file-storage-path", envvar="LLMKIT_FILE_STORAGE_PATH",
                                 help="Root directory of the local storage backend.")] = "./llmkit_storage",
    storage_option: Annotated[Optional[list[str]], typer.Option(
        "--storage-option", help="KEY=VALUE for the storage backend (repeatable), e.g. bucket=..., "
                                 "prefix=..., endpoint_url=...")] = None,
    batch_max_in_flight: Annotated[int, typer.Option("--batch-max-in-flight",
                                   help="Batch lines handed to the engine at once (fewer: faster online responses while a batch runs).")] = 4,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    tp_size: TpSize = 1,
    mem_fraction_static: MemFractionStatic = None,
    trust_remote_code: TrustRemoteCode = False,
):
    """Serve a model behind the OpenAI API (chat, completions, models, files, batches)."""
    params = dict(locals())
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    from llmkit.cli.preflight import bind_socket, check_serve_options
    from llmkit.core.plugins import PluginError

    try:
        # Everything checkable is checked, and the port bound, before the (slow) model load.
        check_serve_options(params)
        if trust_remote_code:
            logging.getLogger("llmkit").info("--trust-remote-code is accepted for SGLang compatibility; llmkit "
                                             "never runs code from a checkpoint, so it changes nothing")
        sock = bind_socket(host, port)
        app = _build_app(params)
    except (PluginError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           timeout_graceful_shutdown=shutdown_timeout,
                                           h11_max_incomplete_event_size=64 * 1024))
    logging.getLogger("llmkit").info("Serving on http://%s:%d", host, port)  # the socket is bound
    server.run(sockets=[sock])


def _build_app(p: dict, batch_storage: str | None = "from-params"):
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.launch import build_server

    config = EngineConfig(
        model_path=p["model_path"], served_model_name=p["served_model_name"], dtype=p["dtype"],
        device=p["device"], attention=p["attention"], page_size=p["page_size"],
        max_total_tokens=p["max_total_tokens"], max_running_requests=p["max_running_requests"],
        max_queued_requests=p["max_queued_requests"], chunked_prefill_size=p["chunked_prefill_size"],
        schedule_policy=p["schedule_policy"], disable_radix_cache=p["disable_radix_cache"],
        context_length=p["context_length"],
        enable_deterministic_inference=p["enable_deterministic_inference"], num_threads=p["num_threads"],
        cuda_graph_max_bs=p["cuda_graph_max_bs"], disable_cuda_graph=p["disable_cuda_graph"],
        quantization=p["quantization"], load_format=p["load_format"],
        overlap_schedule=_overlap(p), mem_fraction_static=p.get("mem_fraction_static"),
    )
    storage = p["batch_storage"] if batch_storage == "from-params" else batch_storage
    return build_server(
        config, api_key=p["api_key"], chat_template=p["chat_template"], reasoning_parser=p["reasoning_parser"],
        tool_call_parser=p["tool_call_parser"], grammar_backend=p["grammar_backend"],
        max_payload_size=p["max_payload_size"], batch_storage=None if storage == "none" else storage,
        file_storage_path=p["file_storage_path"], storage_options=tuple(p["storage_option"] or ()),
        batch_max_in_flight=p["batch_max_in_flight"])


def _overlap(p: dict) -> bool | None:
    if p["disable_overlap_schedule"] and p["enable_overlap_schedule"]:
        raise ValueError("--disable-overlap-schedule and --enable-overlap-schedule contradict each other")
    return False if p["disable_overlap_schedule"] else True if p["enable_overlap_schedule"] else None


@contextlib.contextmanager
def build_app_for_batch(args: list[str]):
    """An app built from ``llmkit serve`` options (no storage, no HTTP listener), for the offline
    batch runner; the engine stops on exit."""
    command = typer.main.get_command(_serve_only_app())
    ctx = command.make_context("serve", list(args))
    params = dict(ctx.params)
    logging.basicConfig(level=params["log_level"].upper(), format="[%(asctime)s] %(message)s")
    from llmkit.cli.preflight import check_serve_options

    check_serve_options({**params, "batch_storage": None}, check_port=False)
    app = _build_app(params, batch_storage=None)
    try:
        yield app
    finally:
        app.state.shutdown()


def _serve_only_app() -> typer.Typer:
    app = typer.Typer()
    app.command("serve")(serve)
    return app
