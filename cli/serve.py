"""``llmkit serve``: load a model and serve the OpenAI API."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Annotated, Optional

import typer

from llmkit.cli.help_format import FlagCommand
from llmkit.cli.options import (
    Attention,
    ChatTemplate,
    ChunkedPrefill,
    ContextLength,
    CudaGraphMaxBs,
    Deterministic,
    Device,
    DisableCudaGraph,
    DisableMetrics,
    DisableOverlap,
    DisableRadix,
    DisableWebUI,
    DistInitAddr,
    DpSize,
    Dtype,
    EnableOverlap,
    EngineProcess,
    GrammarBackend,
    KvCacheDtype,
    LoadFormat,
    MaxRunning,
    MaxTotalTokens,
    MemFractionStatic,
    MetricsNoAuth,
    ModelPath,
    NNodes,
    NodeRank,
    PageSize,
    Quantization,
    QuantizationGroupSize,
    ReasoningParser,
    SchedulePolicy,
    ServedModelName,
    SkipServerWarmup,
    Threads,
    ToolCallParser,
    TpSize,
    TrustRemoteCode,
)


def register(app: typer.Typer) -> None:
    app.command("serve", cls=FlagCommand)(serve)


def serve(
    ctx: typer.Context,
    *,
    model_path: ModelPath = None,
    host: Annotated[str, typer.Option("--host", envvar="LLMKIT_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="LLMKIT_PORT")] = 30000,
    served_model_name: ServedModelName = None,
    chat_template: ChatTemplate = None,
    attention: Attention = "auto",
    reasoning_parser: ReasoningParser = None,
    tool_call_parser: ToolCallParser = None,
    grammar_backend: GrammarBackend = None,
    dtype: Dtype = "auto",
    kv_cache_dtype: KvCacheDtype = "auto",
    device: Device = "auto",
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key", envvar="LLMKIT_API_KEY", help="Require 'Authorization: Bearer KEY' (except /health*)."
        ),
    ] = None,
    context_length: ContextLength = None,
    max_running_requests: MaxRunning = None,
    max_queued_requests: Annotated[
        int, typer.Option("--max-queued-requests", help="Requests held at once; beyond this new ones get 429.")
    ] = 1024,
    max_total_tokens: MaxTotalTokens = None,
    chunked_prefill_size: ChunkedPrefill = 2048,
    schedule_policy: SchedulePolicy = "fcfs",
    disable_radix_cache: DisableRadix = False,
    page_size: PageSize = 1,
    enable_deterministic_inference: Deterministic = False,
    num_threads: Threads = None,
    quantization: Quantization = None,
    quantization_group_size: QuantizationGroupSize = None,
    cuda_graph_max_bs: CudaGraphMaxBs = None,
    disable_cuda_graph: DisableCudaGraph = False,
    skip_server_warmup: SkipServerWarmup = False,
    disable_overlap_schedule: DisableOverlap = False,
    enable_overlap_schedule: EnableOverlap = False,
    load_format: LoadFormat = "auto",
    max_payload_size: Annotated[int, typer.Option("--max-payload-size", help="Request body cap in bytes.")] = 32 << 20,
    shutdown_timeout: Annotated[
        int,
        typer.Option(
            "--shutdown-timeout",
            help="Seconds to drain in-flight requests after SIGTERM (those left then get 503; "
            "a second SIGTERM exits at once).",
        ),
    ] = 30,
    max_prompt_size: Annotated[
        int, typer.Option("--max-prompt-size", help="Prompt cap in characters, checked before tokenizing.")
    ] = 16 << 20,
    max_system_blocks: Annotated[
        int, typer.Option("--max-system-blocks", help="Content blocks an Anthropic system prompt may have.")
    ] = 256,
    max_prompt_logprobs_tokens: Annotated[
        int,
        typer.Option(
            "--max-prompt-logprobs-tokens",
            help="Prompt tokens one request may ask prompt logprobs for (echo, /generate).",
        ),
    ] = 1024,
    queue_timeout: Annotated[
        float,
        typer.Option("--queue-timeout", help="Seconds a request may wait for the engine before a 503 (0: no limit)."),
    ] = 600.0,
    header_timeout: Annotated[
        float,
        typer.Option(
            "--header-timeout", help="Seconds a connection has to send a request's headers before it is closed."
        ),
    ] = 10.0,
    keep_alive_timeout: Annotated[
        float, typer.Option("--keep-alive-timeout", help="Seconds an idle keep-alive connection stays open.")
    ] = 5.0,
    batch_storage: Annotated[
        Optional[str],
        typer.Option(
            "--batch-storage",
            envvar="LLMKIT_BATCH_STORAGE",
            show_default="local",
            help="Storage backend for /v1/files and /v1/batches: local, s3, or a plugin's; "
            "'none' disables the endpoints. Default: the storage plugin registered as default.",
        ),
    ] = None,
    file_storage_path: Annotated[
        str,
        typer.Option(
            "--file-storage-path",
            envvar="LLMKIT_FILE_STORAGE_PATH",
            help="Root directory of the local storage backend.",
        ),
    ] = "./llmkit_storage",
    storage_option: Annotated[
        Optional[list[str]],
        typer.Option(
            "--storage-option",
            help="KEY=VALUE for the storage backend (repeatable), e.g. bucket=..., prefix=..., endpoint_url=...",
        ),
    ] = None,
    batch_max_in_flight: Annotated[
        int,
        typer.Option(
            "--batch-max-in-flight",
            help="Batch lines handed to the engine at once (fewer: faster online responses while a batch runs).",
        ),
    ] = 4,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    tp_size: TpSize = 1,
    dp_size: DpSize = 1,
    nnodes: NNodes = 1,
    node_rank: NodeRank = 0,
    dist_init_addr: DistInitAddr = None,
    mem_fraction_static: MemFractionStatic = None,
    trust_remote_code: TrustRemoteCode = False,
    disable_metrics: DisableMetrics = False,
    metrics_no_auth: MetricsNoAuth = False,
    disable_web_ui: DisableWebUI = False,
    engine_process: EngineProcess = False,
):
    """Serve a model behind the OpenAI API (chat, completions, models, files, batches)."""
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    from llmkit.cli.preflight import bind_socket, check_serve_options
    from llmkit.core.plugins import PluginError

    try:
        # Everything checkable is checked, and the port bound, before the (slow) model load.
        check_serve_options(ctx.params)
        engine_config, server_config = build_configs(**ctx.params)
        if node_rank > 0:  # a node that runs tensor-parallel ranks only: no HTTP server here
            from llmkit.core.engine.procs.tp_node import serve_ranks

            raise typer.Exit(serve_ranks(engine_config))
        if trust_remote_code:
            logging.getLogger("llmkit").info(
                "--trust-remote-code is accepted for SGLang compatibility; llmkit "
                "never runs code from a checkpoint, so it changes nothing"
            )
        sock = bind_socket(host, port)
        app = _build_app(engine_config, server_config)
    except (PluginError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    import uvicorn

    from llmkit.core.server.limits import header_timeout_protocol
    from llmkit.core.server.shutdown import make_server

    # The drain (core/server/shutdown.py) waits --shutdown-timeout for requests; uvicorn's own
    # wait then only covers responses being written.
    server = make_server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=keep_alive_timeout,
            http=header_timeout_protocol(header_timeout),
            h11_max_incomplete_event_size=64 * 1024,
        ),
        app.state.llmkit,
        shutdown_timeout,
    )
    logging.getLogger("llmkit").info("Serving on http://%s:%d", host, port)  # the socket is bound
    server.run(sockets=[sock])
    if app.state.llmkit.client.dead:  # the engine died (its rank and cause are in the log)
        raise typer.Exit(1)


def build_configs(
    *,
    model_path,
    host,
    port,
    served_model_name,
    chat_template,
    attention,
    reasoning_parser,
    tool_call_parser,
    grammar_backend,
    dtype,
    kv_cache_dtype,
    device,
    api_key,
    context_length,
    max_running_requests,
    max_queued_requests,
    max_total_tokens,
    chunked_prefill_size,
    schedule_policy,
    disable_radix_cache,
    page_size,
    enable_deterministic_inference,
    num_threads,
    quantization,
    quantization_group_size,
    cuda_graph_max_bs,
    disable_cuda_graph,
    skip_server_warmup,
    disable_overlap_schedule,
    enable_overlap_schedule,
    load_format,
    max_payload_size,
    shutdown_timeout,
    max_prompt_size,
    max_system_blocks,
    max_prompt_logprobs_tokens,
    queue_timeout,
    header_timeout,
    keep_alive_timeout,
    batch_storage,
    file_storage_path,
    storage_option,
    batch_max_in_flight,
    log_level,
    tp_size,
    dp_size,
    nnodes,
    node_rank,
    dist_init_addr,
    mem_fraction_static,
    trust_remote_code,
    disable_metrics,
    metrics_no_auth,
    disable_web_ui,
    engine_process,
):
    """The engine and server configs from ``llmkit serve``'s options (keyword-only: every option
    is named once here, and a new option that is not placed in a config fails loudly). The
    options are checked first, by ``check_serve_options``."""
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.server.config import ServerConfig

    engine = EngineConfig(
        model_path=model_path,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        device=device,
        attention=attention,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        max_running_requests=max_running_requests,
        max_queued_requests=max_queued_requests,
        chunked_prefill_size=chunked_prefill_size,
        schedule_policy=schedule_policy,
        disable_radix_cache=disable_radix_cache,
        context_length=context_length,
        enable_deterministic_inference=enable_deterministic_inference,
        num_threads=num_threads,
        cuda_graph_max_bs=cuda_graph_max_bs,
        disable_cuda_graph=disable_cuda_graph,
        warmup=False if skip_server_warmup else None,
        quantization=quantization,
        quantization_group_size=quantization_group_size,
        load_format=load_format,
        grammar_backend=grammar_backend,
        mem_fraction_static=mem_fraction_static,
        engine_process=engine_process or dp_size > 1 or tp_size > 1,
        dp_size=dp_size,
        tp_size=tp_size,
        nnodes=nnodes,
        node_rank=node_rank,
        dist_init_addr=dist_init_addr,
        overlap_schedule=False if disable_overlap_schedule else True if enable_overlap_schedule else None,
    )
    server = ServerConfig(
        served_model_name=(served_model_name or [""])[0],
        served_model_aliases=tuple((served_model_name or [])[1:]),
        host=host,
        port=port,
        api_key=api_key,
        chat_template=chat_template,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
        max_payload_size=max_payload_size,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        max_prompt_size=max_prompt_size,
        max_system_blocks=max_system_blocks,
        max_prompt_logprobs_tokens=max_prompt_logprobs_tokens,
        queue_timeout=queue_timeout,
        header_timeout=header_timeout,
        keep_alive_timeout=keep_alive_timeout,
        enable_batches=batch_storage != "none",
        batch_storage=None if batch_storage == "none" else batch_storage,
        file_storage_path=file_storage_path,
        storage_options=tuple(storage_option or ()),
        batch_max_in_flight=batch_max_in_flight,
        enable_metrics=not disable_metrics,
        metrics_no_auth=metrics_no_auth,
        enable_web_ui=not disable_web_ui,
    )
    return engine, server


def _build_app(engine_config, server_config):
    from llmkit.core.launch import build_server

    return build_server(engine_config, server_config)


@contextlib.contextmanager
def batch_executor_for(args: list[str]):
    """The batch executor of a server built from ``llmkit serve`` options (no storage, no HTTP
    listener): the same executor online batches use. The engine stops on exit."""
    from llmkit.core.batches.executor import make_batch_executor

    command = typer.main.get_command(_serve_only_app())
    ctx = command.make_context("serve", list(args))
    from llmkit.cli.preflight import check_serve_options

    check_serve_options({**ctx.params, "batch_storage": None}, check_port=False)
    engine_config, server_config = build_configs(**ctx.params)
    logging.basicConfig(level=server_config.log_level.upper(), format="[%(asctime)s] %(message)s")
    app = _build_app(engine_config, replace(server_config, enable_batches=False))
    try:
        yield make_batch_executor(app.state.llmkit)
    finally:
        app.state.shutdown()


def _serve_only_app() -> typer.Typer:
    app = typer.Typer()
    app.command("serve", cls=FlagCommand)(serve)
    return app
