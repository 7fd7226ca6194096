"""``llmkit serve``'s options for the durable /v1/batches and /v1/files and where they are kept."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel


def _batch_storage(name, _) -> dict:
    return {"server.enable_batches": name != "none", "server.batch_storage": None if name == "none" else name}


BATCH_OPTIONS = panel(
    "Batches and storage",
    ServeOption(
        ("--batch-storage",),
        Optional[str],
        None,
        to=_batch_storage,
        envvar="LLMKIT_BATCH_STORAGE",
        help="Storage backend for /v1/files and /v1/batches: local, s3, or a plugin's; "
        "'none' disables the endpoints. Default: the storage plugin registered as default.",
        typer_args={"show_default": "local"},
    ),
    ServeOption(
        ("--file-storage-path",),
        str,
        "./llmkit_storage",
        to="server",
        envvar="LLMKIT_FILE_STORAGE_PATH",
        help="Root directory of the local storage backend.",
    ),
    ServeOption(
        ("--storage-option",),
        Optional[list[str]],
        None,
        to=lambda pairs, _: {"server.storage_options": tuple(pairs or ())},
        help="KEY=VALUE for the storage backend (repeatable), e.g. bucket=..., prefix=..., endpoint_url=...",
    ),
    ServeOption(
        ("--batch-max-in-flight",),
        int,
        4,
        to="server",
        help="Batch lines handed to the engine at once (fewer: faster online responses while a batch runs).",
    ),
    ServeOption(
        ("--batch-lease-ttl",),
        float,
        30.0,
        to="server",
        envvar="LLMKIT_BATCH_LEASE_TTL",
        help="Seconds a replica's claim on a running batch lasts unrenewed (renewed every third of it): "
        "replicas sharing the storage take over a batch whose runner died once its claim expires.",
    ),
)
