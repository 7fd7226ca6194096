"""``llmkit serve``'s options for tensor- and data-parallel ranks, on one node or several."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel

PARALLEL_OPTIONS = panel(
    "Parallelism",
    ServeOption(
        ("--tp-size", "--tp", "--tensor-parallel-size"),
        int,
        1,
        to="engine",
        help="Tensor parallelism: this many ranks (processes; one GPU each on CUDA, gloo on CPU) share every layer.",
        typer_args={"min": 1},
    ),
    ServeOption(
        ("--dp-size", "--dp", "--data-parallel-size"),
        int,
        1,
        to="engine",
        envvar="LLMKIT_DP_SIZE",
        help="Data parallelism: this many engine replicas, each in its own process, behind one server; "
        "requests go to the least loaded replica, or to the one holding their prompt's prefix.",
        typer_args={"min": 1},
    ),
    ServeOption(
        ("--nnodes",),
        int,
        1,
        to="engine",
        help="Nodes the --tp-size ranks are spread over (node 0 serves HTTP).",
        typer_args={"min": 1},
    ),
    ServeOption(
        ("--node-rank",),
        int,
        0,
        to="engine",
        help="This node's index (0..nnodes-1); nodes > 0 run ranks only.",
        typer_args={"min": 0},
    ),
    ServeOption(
        ("--dist-init-addr", "--dist-init-address"),
        Optional[str],
        None,
        to="engine",
        help="HOST:PORT where the ranks meet (torch.distributed TCP rendezvous); needed with --nnodes > 1.",
    ),
)
