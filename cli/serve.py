"""``llmkit serve``: load a model and serve the OpenAI API."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Optional

import typer

from llmkit.cli.options import (Attention, ChatTemplate, ChunkedPrefill, ContextLength, Deterministic, Device,
                                DisableRadix, Dtype, GrammarBackend, MaxRunning, MaxTotalTokens, ModelPath,
                                PageSize, ReasoningParser, SchedulePolicy, Threads, ToolCallParser)


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        model_path: ModelPath = None,
        host: Annotated[str, typer.Option("--host", envvar="LLMKIT_HOST")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", envvar="LLMKIT_PORT")] = 30000,
        served_model_name: Annotated[Optional[str], typer.Option("--served-model-name")] = None,
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
        max_payload_size: Annotated[int, typer.Option("--max-payload-size", help="Request body cap in bytes.")] = 32 << 20,
        shutdown_timeout: Annotated[int, typer.Option("--shutdown-timeout",
                                    help="Seconds to drain in-flight requests after SIGTERM.")] = 30,
        log_level: Annotated[str, typer.Option("--log-level")] = "info",
    ):
        """Serve a model behind the OpenAI API (chat, completions, models)."""
        logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S")
        from llmkit.core.config import EngineConfig
        from llmkit.core.plugins import PluginError
        from llmkit.core.server.launch import build_server

        config = EngineConfig(
            model_path=model_path, served_model_name=served_model_name, dtype=dtype, device=device,
            attention=attention, page_size=page_size, max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests, max_queued_requests=max_queued_requests,
            chunked_prefill_size=chunked_prefill_size, schedule_policy=schedule_policy,
            disable_radix_cache=disable_radix_cache, context_length=context_length,
            enable_deterministic_inference=enable_deterministic_inference, num_threads=num_threads,
        )
        try:
            app = build_server(config, api_key=api_key, chat_template=chat_template,
                               reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                               grammar_backend=grammar_backend, max_payload_size=max_payload_size)
        except (PluginError, FileNotFoundError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        import uvicorn

        logging.getLogger("llmkit").info("Serving on http://%s:%d (config: %s)", host, port,
                                         json.dumps({"attention": attention, "model": model_path or "embedded"}))
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=shutdown_timeout,
                    h11_max_incomplete_event_size=64 * 1024)
