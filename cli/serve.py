"""``llmkit serve``: load a model and serve the OpenAI API."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import typer

from llmkit.cli.help_format import FlagCommand
from llmkit.cli.option_table import signature
from llmkit.cli.serve_options import MULTI_VALUE_FLAGS, SERVE_OPTIONS, build_configs


class ServeCommand(FlagCommand):
    multi_value_flags = MULTI_VALUE_FLAGS


def register(app: typer.Typer) -> None:
    app.command("serve", cls=ServeCommand)(serve)


def serve(**params):
    """Serve a model behind the OpenAI API (chat, completions, models, files, batches)."""
    log_level = params["log_level"]
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    from llmkit.cli.listen import bind_socket
    from llmkit.core.plugins import PluginError
    from llmkit.core.refusals import check_configs

    try:
        # Everything checkable is checked, and the port bound, before the (slow) model load.
        checked = check_configs(*build_configs(params))
        engine_config, server_config = checked.engine, checked.server
        if engine_config.node_rank > 0:  # a node that runs tensor-parallel ranks only: no HTTP server here
            from llmkit.core.engine.procs.tp_node import serve_ranks

            raise typer.Exit(serve_ranks(engine_config))
        if engine_config.trust_remote_code:
            logging.getLogger("llmkit").info(
                "--trust-remote-code is accepted for SGLang compatibility; llmkit "
                "never runs code from a checkpoint, so it changes nothing"
            )
        sock = bind_socket(server_config.host, server_config.port)
        from llmkit.core.launch import build_checked_server

        app = build_checked_server(checked)
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
            host=server_config.host,
            port=server_config.port,
            log_level=log_level.lower(),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server_config.keep_alive_timeout,
            http=header_timeout_protocol(server_config.header_timeout, server_config.max_connections),
            h11_max_incomplete_event_size=64 * 1024,
        ),
        app.state.llmkit,
        server_config.shutdown_timeout,
    )
    # True already: the socket is bound.
    logging.getLogger("llmkit").info("Serving on http://%s:%d", server_config.host, server_config.port)
    from llmkit.core.engine.stages.startup_gc import freeze_after_startup

    freeze_after_startup()
    server.run(sockets=[sock])
    if app.state.llmkit.client.dead:  # the engine died (its rank and cause are in the log)
        raise typer.Exit(1)


# Typer reads a command's parameters from its signature: serve's come from the option table.
serve.__signature__ = signature(SERVE_OPTIONS)


@contextlib.contextmanager
def batch_executor_for(args: list[str]):
    """The batch executor of a server built from ``llmkit serve`` options (no storage, no HTTP
    listener): the same executor online batches use. The engine stops on exit."""
    from llmkit.core.batches.executor import make_batch_executor
    from llmkit.core.launch import build_server

    command = typer.main.get_command(_serve_only_app())
    ctx = command.make_context("serve", list(args))
    engine_config, server_config = build_configs(ctx.params)
    logging.basicConfig(level=server_config.log_level.upper(), format="[%(asctime)s] %(message)s")
    app = build_server(engine_config, replace(server_config, enable_batches=False), listening=False)
    try:
        yield make_batch_executor(app.state.llmkit)
    finally:
        app.state.shutdown()


def _serve_only_app() -> typer.Typer:
    app = typer.Typer()
    app.command("serve", cls=ServeCommand)(serve)
    return app
