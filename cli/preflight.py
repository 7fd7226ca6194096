"""Checks of ``llmkit serve`` options that run before the model loads.

Loading the model and allocating the KV pool takes seconds to minutes, so every mistake that can be
found without them is found first, and reported as one line saying what is wrong and what to do
(:class:`OptionError`), never as a traceback. The listening socket is bound here too, so a port in
use fails at once instead of after the load.
"""

from __future__ import annotations

import socket
from pathlib import Path

from llmkit.cli.serve_options import SERVE_OPTIONS

DTYPES = ("auto", "float32", "fp32", "float16", "half", "bfloat16", "bf16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8_e4m3", "fp8", "fp8_e5m2")
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
INT4_GROUP_SIZES = (32, 64, 128, 256)
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOAD_FORMATS = ("auto", "dummy")
FLAGS = {row.name: row.flags[0] for row in SERVE_OPTIONS}  # by parameter name: page_size -> --page-size


class OptionError(ValueError):
    """A user mistake on the command line; the message is the whole report."""


def check_serve_options(p: dict, *, check_port: bool = True) -> None:
    """Raise :class:`OptionError` for the first invalid option in ``p`` (serve's parameters)."""
    if check_port and not 1 <= p["port"] <= 65535:
        raise OptionError(f"--port {p['port']} is out of range: use a port from 1 to 65535")
    for key in (
        "page_size",
        "max_running_requests",
        "max_queued_requests",
        "chunked_prefill_size",
        "context_length",
        "max_total_tokens",
        "num_threads",
        "batch_max_in_flight",
        "max_system_blocks",
        "max_prompt_logprobs_tokens",
        "max_loras_per_batch",
        "max_lora_rank",
        "max_loaded_loras",
    ):
        value = p.get(key)
        if value is not None and value < 1:
            raise OptionError(f"{FLAGS[key]} must be at least 1 (got {value})")
    for key in ("max_payload_size", "max_prompt_size", "header_timeout", "keep_alive_timeout", "batch_lease_ttl"):
        value = p.get(key)
        if value is not None and value <= 0:
            raise OptionError(f"{FLAGS[key]} must be positive (got {value})")
    for key in ("queue_timeout", "shutdown_timeout", "rate_limit_rpm", "rate_limit_tpm"):
        value = p.get(key)
        if value is not None and value < 0:
            raise OptionError(f"{FLAGS[key]} must be 0 or more (got {value})")
    _check_paths(p)
    _check_keys(p)
    _check_gateway_urls(p)
    _check_choice("--dtype", p["dtype"], DTYPES)
    _check_choice("--kv-cache-dtype", p["kv_cache_dtype"], KV_CACHE_DTYPES)
    _check_choice("--schedule-policy", p["schedule_policy"], SCHEDULE_POLICIES)
    _check_choice("--load-format", p["load_format"], LOAD_FORMATS)
    if p["quantization"] is not None:
        _check_choice("--quantization", p["quantization"], QUANTIZATIONS)
    _check_plugins(p)
    device = _check_device(p["device"])
    _check_attention(p["attention"], device)
    group = p.get("quantization_group_size")
    if group is not None:
        if p["quantization"] != "int4":
            raise OptionError(
                "--quantization-group-size applies to --quantization int4 only: add it or leave the size out"
            )
        if group not in INT4_GROUP_SIZES:
            raise OptionError(
                f"--quantization-group-size {group} is not supported; valid: {', '.join(map(str, INT4_GROUP_SIZES))}"
            )
    if p["quantization"] not in (None, "none") and device != "cpu":
        raise OptionError(
            f"--quantization {p['quantization']} is a CPU decode path; on CUDA leave it out (or add --device cpu)"
        )
    if p.get("disable_overlap_schedule") and p.get("enable_overlap_schedule"):
        raise OptionError(
            "--disable-overlap-schedule and --enable-overlap-schedule contradict each other: give one of them"
        )
    if p.get("skip_server_warmup") and p.get("enable_server_warmup"):
        raise OptionError("--skip-server-warmup and --enable-server-warmup contradict each other: give one of them")
    tp, dp = p.get("tp_size", 1), p.get("dp_size", 1)
    _check_nodes(tp, dp, p.get("nnodes", 1), p.get("node_rank", 0), p.get("dist_init_addr"))
    if tp > 1 and device == "cuda":
        import torch

        if torch.cuda.device_count() < tp * dp:
            raise OptionError(
                f"--tp-size {tp} x --dp-size {dp} needs {tp * dp} GPUs (one per rank); "
                f"{torch.cuda.device_count()} visible"
            )
    if dp > 1 and tp == 1 and device == "cuda":
        import torch

        if p["device"].startswith("cuda:"):
            raise OptionError(f"--dp-size {dp} puts replica i on cuda:i; give --device cuda (or auto), not one GPU")
        if torch.cuda.device_count() < dp:
            raise OptionError(f"--dp-size {dp} needs {dp} GPUs (one per replica); {torch.cuda.device_count()} visible")
    _check_lora(p)
    frac = p.get("mem_fraction_static")
    if frac is not None and not 0 < frac < 1:
        raise OptionError(f"--mem-fraction-static {frac} must be between 0 and 1 (e.g. 0.8)")


def _check_lora(p: dict) -> None:
    specs, targets = p.get("lora_paths") or [], p.get("lora_target_modules") or []
    lora_dir = p.get("lora_dir")
    if lora_dir is not None and not Path(lora_dir).expanduser().is_dir():
        raise OptionError(f"--lora-dir '{lora_dir}' is not a directory")
    if not (specs or targets or lora_dir or p.get("enable_lora") or p.get("lora_resolver")):
        return
    from llmkit.core.lora.options import parse_lora_paths, target_set

    try:
        target_set(targets)
        names = [name for name, _ in parse_lora_paths(specs)]
    except ValueError as exc:
        raise OptionError(f"--lora-paths: {exc}" if "target" not in str(exc) else str(exc)) from None
    if len(set(names)) != len(names):
        raise OptionError(f"--lora-paths names an adapter twice: {names}")


def _check_nodes(tp: int, dp: int, nnodes: int, node_rank: int, addr: str | None) -> None:
    if node_rank >= nnodes:
        raise OptionError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if nnodes > 1:
        if tp % nnodes:
            raise OptionError(f"--tp-size {tp} must be a multiple of --nnodes {nnodes} (the same ranks on every node)")
        if dp > 1:
            raise OptionError("--dp-size with --nnodes > 1 is not supported: run one multi-node replica")
        if not addr:
            raise OptionError("--nnodes > 1 needs --dist-init-addr HOST:PORT (where node 0's rank 0 listens)")
    if addr is not None and dp > 1:
        raise OptionError("--dist-init-addr with --dp-size > 1: each replica picks its own rendezvous; leave it out")
    if addr is not None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise OptionError(f"--dist-init-addr '{addr}' must be HOST:PORT")


def _check_choice(flag: str, value: str, valid) -> None:
    if value not in valid:
        raise OptionError(f"unknown {flag} '{value}'; valid: {', '.join(valid)}")


def _check_paths(p: dict) -> None:
    model = p.get("model_path")
    from llmkit.core.model.loader.embedded_encoder import is_embedded_encoder

    if model is not None and not is_embedded_encoder(model):  # the packaged encoder is named, not a path
        path = Path(model).expanduser()
        if not path.exists():
            raise OptionError(
                f"--model-path '{model}' does not exist: give a .gguf file or a Hugging Face "
                "model directory (weights are never downloaded)"
            )
        if path.is_file() and path.suffix != ".gguf":
            raise OptionError(
                f"--model-path '{model}' is a file but not a .gguf: give a .gguf file or a Hugging Face model directory"
            )
        if path.is_dir() and not (path / "config.json").exists():
            raise OptionError(
                f"--model-path '{model}' has no config.json: give a Hugging Face model "
                "directory (config.json, safetensors, tokenizer files) or a .gguf file"
            )
    template = p.get("chat_template")
    if template is not None and not Path(template).expanduser().is_file():
        raise OptionError(f"--chat-template '{template}' does not exist: give a Jinja template file")


def _check_keys(p: dict) -> None:
    from llmkit.core.server.access.keys import KeysFileError, load_keys

    try:
        load_keys(p.get("api_key") or (), p.get("api_keys_file"))
    except KeysFileError as exc:
        raise OptionError(str(exc)) from None


def _check_gateway_urls(p: dict) -> None:
    for key in ("gateway_url", "gateway_worker_url"):
        url = p.get(key)
        if url is not None and not url.startswith(("http://", "https://")):
            raise OptionError(f"{FLAGS[key]} {url!r} must be an http:// or https:// URL")
    if p.get("gateway_worker_url") and not p.get("gateway_url"):
        raise OptionError("--gateway-worker-url is the URL given to --gateway-url's gateway: give --gateway-url too")


def _check_plugins(p: dict) -> None:
    from llmkit.core.plugins import registry

    reg = registry()
    checks = [
        ("--grammar-backend", "grammar", p["grammar_backend"], ("none",), "grammar backend"),
        ("--reasoning-parser", "reasoning_parser", p["reasoning_parser"], (), "reasoning parser"),
        ("--tool-call-parser", "tool_parser", p["tool_call_parser"], (), "tool-call parser"),
        ("--attention", "attention", p["attention"], ("auto",), "attention backend"),
    ]
    if p.get("batch_storage") not in (None, "none"):
        checks.append(("--batch-storage", "storage", p["batch_storage"], ("none",), "storage backend"))
    for flag, kind, value, extra, what in checks:
        if value is None or value in extra:
            continue
        names = reg.names(kind)
        if value not in names:
            valid = ", ".join(dict.fromkeys([*extra, *names]))  # a plugin may also be named "none"
            raise OptionError(f"unknown {what} '{value}' ({flag}); valid: {valid}")


def _check_attention(name: str, device: str) -> None:
    """A backend that cannot run on the device is refused now, not after the model loads."""
    if name in (None, "auto"):
        return
    import torch

    from llmkit.core.plugins import PluginError, registry

    try:
        why = registry().attention_backend(name).availability(torch.device(device))
    except PluginError as exc:
        raise OptionError(f"--attention {name}: {exc}") from None
    if why is not None:
        raise OptionError(f"--attention {name} cannot run on {device}: {why}")


def _check_device(device: str) -> str:
    """The device type the engine will use ('cpu' or 'cuda')."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "unable to see a GPU"
            raise OptionError(
                f"--device {device}: CUDA is not available (torch {torch.__version__} is {build}); "
                "use --device cpu, or install a CUDA build of torch on a GPU machine"
            )
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise OptionError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
        return "cuda"
    raise OptionError(f"unknown --device '{device}'; valid: auto, cpu, cuda, cuda:N")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads (uvicorn serves on it later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OptionError(
            f"--host '{host}' cannot be resolved ({exc.strerror}): give an IP address or a host name of this machine"
        ) from None
    family, _, _, _, addr = infos[0]
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY on the accepted connections only when the
    # socket says it is TCP. Without it a kept-alive connection's response waited 40 ms for the
    # client's delayed ACK (Nagle), on every request after a connection's first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        hint = (
            "another process is listening there: stop it or choose another --port"
            if exc.errno == 98
            else "choose another --host or --port"
        )
        raise OptionError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock
