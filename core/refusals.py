"""The one place that refuses a configuration, before anything slow runs.

``llmkit serve`` and the Python API (``build_server``) both call :func:`check_configs`, so the
command line and a program can never disagree on what is allowed. It runs each option field's own
check (``core/option.py``: ranges, allowed values, plugin names), then the rules between options
and the device-aware ones, reading at most a model's config.json, never its weights. Every
refusal is an :class:`OptionError` whose message names the flag and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from llmkit.core.engine.config import EngineConfig
from llmkit.core.option import OptionError, allowed, options
from llmkit.core.server.config import ServerConfig

# What a plugin kind's names are called in a refusal.
_PLUGIN_NOUNS = {
    "attention": "attention backend",
    "grammar": "grammar backend",
    "reasoning_parser": "reasoning parser",
    "tool_parser": "tool-call parser",
    "storage": "storage backend",
    "speculative_algorithm": "speculative algorithm",
    "lora_resolver": "LoRA resolver",
    "kv_storage": "KV storage backend",
}


@dataclass(frozen=True)
class Checked:
    """Configs that passed :func:`check_configs`, with what the checks found out on the way."""

    engine: EngineConfig
    server: ServerConfig
    device: str  # "cpu" or "cuda"
    embedding_dir: Path | None  # the model's directory when it serves embeddings or scores


def check_configs(engine: EngineConfig, server: ServerConfig, *, listening: bool = True) -> Checked:
    """Raise :class:`OptionError` for the first thing wrong with the two configs; return them with
    the implied settings applied (``--batch-storage none``, adapters loaded at run time).
    ``listening``: whether the server will listen (a batch run's does not: its port is not checked)."""
    engine, server = _implied(engine, server)
    engine, server = _resolve_hub_id(engine, server)
    for config in (engine, server):
        _check_fields(config, skip=() if listening else ("port",))
    _check_paths(engine, server)
    _check_keys(server)
    if server.gateway_worker_url and not server.gateway_url:
        raise OptionError("--gateway-worker-url is the URL given to --gateway-url's gateway: give --gateway-url too")
    device = _check_device(engine.device)
    _check_attention(engine.attention, device)
    _check_quantization(engine, device)
    _check_parallel(engine, device)
    _check_lora(engine)
    _check_speculative(engine)
    _check_kv_tier(engine)
    from llmkit.core.embedding.recognition import embedding_model_dir

    try:
        embedding_dir = embedding_model_dir(engine.model_path, server.is_embedding, server.is_reranker)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if embedding_dir is not None:
        _refuse_generation_options(engine, server)
    return Checked(engine, server, device, embedding_dir)


def _implied(engine: EngineConfig, server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    if server.batch_storage == "none":
        server = replace(server, enable_batches=False, batch_storage=None)
    if (server.lora_dir is not None or server.lora_resolver is not None) and not engine.enable_lora:
        engine = replace(engine, enable_lora=True)  # adapters may be loaded at run time
    return engine, server


def _resolve_hub_id(engine: EngineConfig, server: ServerConfig) -> tuple[EngineConfig, ServerConfig]:
    """A ``--model-path`` given as a Hugging Face id becomes the local path it resolves to (the
    hub cache's snapshot, or a GGUF in it); the id stays the served name unless one is given."""
    from llmkit.core.model.loader.embedded_encoder import is_embedded_encoder
    from llmkit.core.model.loader.hub import HubModelNotFound, parse_hub_ref, resolve_hub_model

    model = engine.model_path
    if model is None or is_embedded_encoder(model) or parse_hub_ref(model) is None:
        return engine, server
    try:
        local = resolve_hub_model(model, engine.revision)
    except HubModelNotFound as exc:
        raise OptionError(str(exc)) from None
    if not server.served_model_name:
        server = replace(server, served_model_name=model)
    return replace(engine, model_path=local), server


def _check_fields(config, skip: tuple[str, ...] = ()) -> None:
    for f, opt in options(type(config)):
        value = getattr(config, f.name)
        if value is None or f.name in skip:
            continue
        why = opt.check(value) if opt.check else None
        if why:
            raise OptionError(f"{opt.flag} {why}")
        valid = allowed(opt)
        if valid is not None and value not in valid:
            if opt.plugin:
                noun = _PLUGIN_NOUNS.get(opt.plugin, opt.plugin)
                raise OptionError(f"unknown {noun} '{value}' ({opt.flag}); valid: {', '.join(valid)}")
            raise OptionError(f"unknown {opt.flag} '{value}'; valid: {', '.join(valid)}")


def _check_paths(engine: EngineConfig, server: ServerConfig) -> None:
    from llmkit.core.model.loader.embedded_encoder import is_embedded_encoder

    model = engine.model_path
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
    template = server.chat_template
    if template is not None and not Path(template).expanduser().is_file():
        raise OptionError(f"--chat-template '{template}' does not exist: give a Jinja template file")
    if server.lora_dir is not None and not Path(server.lora_dir).expanduser().is_dir():
        raise OptionError(f"--lora-dir '{server.lora_dir}' is not a directory")
    from llmkit.core.server.generation.sampling_defaults import generation_config_path

    try:
        generation_config_path(server.generation_config, None)  # a path given by name must hold the file
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def _check_keys(server: ServerConfig) -> None:
    from llmkit.core.server.access.keys import KeysFileError, load_keys

    try:
        load_keys(server.api_keys, server.api_keys_file)
    except KeysFileError as exc:
        raise OptionError(str(exc)) from None


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


def _check_attention(name: str, device: str) -> None:
    """A backend that cannot run on the device is refused now, not after the model loads."""
    if name == "auto":
        return
    import torch

    from llmkit.core.plugins import PluginError, registry

    try:
        why = registry().attention_backend(name).availability(torch.device(device))
    except PluginError as exc:
        raise OptionError(f"--attention {name}: {exc}") from None
    if why is not None:
        raise OptionError(f"--attention {name} cannot run on {device}: {why}")


def _check_quantization(engine: EngineConfig, device: str) -> None:
    from llmkit.core.model.loader.source import gguf_path_of

    method = engine.quantization
    if engine.quantization_group_size is not None and method != "int4":
        raise OptionError("--quantization-group-size applies to --quantization int4 only: add it or leave the size out")
    if method == "gguf" and gguf_path_of(engine.model_path) is None:
        raise OptionError("--quantization gguf serves a GGUF's own quantized weights: give a .gguf --model-path")
    # int4 has a Triton kernel on CUDA; int8 and a GGUF's own blocks have CPU kernels only.
    if method in ("int8", "gguf") and device != "cpu":
        raise OptionError(
            f"--quantization {method} is a CPU decode path; on CUDA use int4, leave it out (a GGUF is then "
            "dequantized), or add --device cpu"
        )


def _check_parallel(engine: EngineConfig, device: str) -> None:
    tp, dp, nnodes, addr = engine.tp_size, engine.dp_size, engine.nnodes, engine.dist_init_addr
    if engine.node_rank >= nnodes:
        raise OptionError(f"--node-rank {engine.node_rank} must be below --nnodes {nnodes}")
    if nnodes > 1:
        if tp % nnodes:
            raise OptionError(f"--tp-size {tp} must be a multiple of --nnodes {nnodes} (the same ranks on every node)")
        if dp > 1:
            raise OptionError("--dp-size with --nnodes > 1 is not supported: run one multi-node replica")
        if not addr:
            raise OptionError("--nnodes > 1 needs --dist-init-addr HOST:PORT (where node 0's rank 0 listens)")
    if addr is not None and dp > 1:
        raise OptionError("--dist-init-addr with --dp-size > 1: each replica picks its own rendezvous; leave it out")
    if device != "cuda" or tp * dp == 1:
        return
    import torch

    visible = torch.cuda.device_count()
    if tp > 1 and visible < tp * dp:
        raise OptionError(f"--tp-size {tp} x --dp-size {dp} needs {tp * dp} GPUs (one per rank); {visible} visible")
    if dp > 1 and tp == 1:
        if engine.device.startswith("cuda:"):
            raise OptionError(f"--dp-size {dp} puts replica i on cuda:i; give --device cuda (or auto), not one GPU")
        if visible < dp:
            raise OptionError(f"--dp-size {dp} needs {dp} GPUs (one per replica); {visible} visible")


def _check_kv_tier(engine: EngineConfig) -> None:
    """What the storage tier is not served with, refused before the model loads (a hybrid model
    and window layers' pages are refused once the model is known: engine/builder.py)."""
    if not (engine.enable_hierarchical_cache or engine.hicache_storage_backend):
        return
    if engine.disable_radix_cache:
        raise OptionError("--enable-hierarchical-cache keeps the radix cache's prefixes: drop --disable-radix-cache")
    if engine.tp_size > 1:  # (each rank holds a shard of the heads: a write per rank, not yet)
        raise OptionError("--enable-hierarchical-cache is not served with --tp-size > 1 yet")


def _check_lora(engine: EngineConfig) -> None:
    if not (engine.lora_paths or engine.lora_target_modules or engine.enable_lora):
        return
    from llmkit.core.lora.options import parse_lora_paths, target_set

    try:
        target_set(engine.lora_target_modules)
        names = [name for name, _ in parse_lora_paths(engine.lora_paths)]
    except ValueError as exc:
        raise OptionError(f"--lora-paths: {exc}" if "target" not in str(exc) else str(exc)) from None
    if len(set(names)) != len(names):
        raise OptionError(f"--lora-paths names an adapter twice: {names}")


def _check_speculative(engine: EngineConfig) -> None:
    algorithm = engine.speculative_algorithm
    if not algorithm:
        return
    from llmkit.core.plugins import registry

    proposer = registry().speculative_algorithm(algorithm)
    topk = engine.speculative_eagle_topk
    if topk not in (None, 1) and not getattr(proposer, "drafts_trees", False):
        raise OptionError(
            f"--speculative-eagle-topk {topk}: {algorithm} drafts one chain, not a tree of several "
            "candidates a step (use --speculative-eagle-topk 1)"
        )
    name = engine.speculative_draft_device
    if not name:
        return
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise OptionError(f"--speculative-draft-device {name}: use cpu, cuda or cuda:N")
    if not getattr(proposer, "runs_on_any_device", False):
        raise OptionError(
            f"--speculative-draft-device places a draft model (STANDALONE); {algorithm} has none of its own "
            "to place (it drafts from the text or from the target's tensors, on the target's device)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"--speculative-draft-device {name}: CUDA is not available")


def _refuse_generation_options(engine: EngineConfig, server: ServerConfig) -> None:
    """An embedding or reranking model runs in one thread of the server, whole, with no decoding:
    a flag for generation is refused rather than ignored (it would not do what was asked)."""
    given = [
        opt.flag
        for config in (engine, server)
        for f, opt in options(type(config))
        if opt.generation_only and getattr(config, f.name) != f.default  # option() gives every field one
    ]
    if engine.quantization == "none":  # asks for nothing
        given.remove("--quantization")
    if given:
        raise OptionError(
            f"{engine.model_path}: an embedding or reranking model runs in the server's own process "
            f"and does not decode; {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to "
            "generation models only"
        )
