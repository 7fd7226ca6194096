"""``llmkit serve``'s options for adapters served over the base model, loaded at start or at run time."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, panel

LORA_OPTIONS = panel(
    "LoRA adapters",
    ServeOption(
        ("--lora-paths", "--lora-modules"),
        Optional[list[str]],
        None,
        to=lambda specs, _: {"engine.lora_paths": tuple(specs or ())},
        help="LoRA adapters served from the start, name=path (PEFT directories); several may follow "
        "one flag. A request picks one with model: <name> (or lora_path).",
    ),
    ServeOption(
        ("--enable-lora",),
        bool,
        False,
        # --lora-dir and --lora-resolver load at run time
        to=lambda on, p: {"engine.enable_lora": on or p["lora_dir"] is not None or p["lora_resolver"] is not None},
        help="Serve LoRA adapters loaded at run time (POST /load_lora_adapter) with none given at start.",
    ),
    ServeOption(
        ("--max-loras-per-batch",),
        int,
        8,
        to="engine",
        help="Distinct LoRA adapters one batch mixes (requests of others wait their turn).",
    ),
    ServeOption(("--max-lora-rank",), int, 64, to="engine", help="The largest LoRA rank accepted."),
    ServeOption(
        ("--lora-target-modules",),
        Optional[list[str]],
        None,
        to=lambda mods, _: {"engine.lora_target_modules": tuple(mods or ())},
        help="Projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
        "or all (the default).",
    ),
    ServeOption(
        ("--lora-dir",),
        Optional[str],
        None,
        to="server",
        help="A directory of PEFT adapters: a request naming an adapter that is not loaded loads <dir>/<name>.",
    ),
    ServeOption(
        ("--lora-resolver",),
        Optional[str],
        None,
        to="server",
        help="Where an adapter a request names but the server has not loaded comes from: dir (--lora-dir, "
        "the default with it), storage (loras/<name>/ in the storage backend, e.g. the S3 bucket), or a plugin's.",
    ),
    ServeOption(
        ("--max-loaded-loras",),
        Optional[int],
        None,
        to="server",
        help="Most adapters loaded at once: past it the least recently used one is unloaded (default: no limit).",
    ),
)
