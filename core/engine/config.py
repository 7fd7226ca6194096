"""Engine configuration (frozen). Each field a user may set is a serve option, declared here
once with its flags, help and check (``core/option.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from llmkit.core.option import at_least, fraction, host_port, non_negative, one_of, option

_model = partial(option, panel="Model and kernels")
_sched = partial(option, panel="Scheduling and memory")
_par = partial(option, panel="Parallelism")
_spec = partial(option, panel="Speculative decoding")
_lora = partial(option, panel="LoRA adapters")

# The tables that own the allowed values, read when an option is checked (torch is not imported
# for --help).
_DTYPES = "llmkit.core.engine.stages.plan:DTYPES"
_KV_DTYPES = "llmkit.core.kvcache.kv_pool:KV_CACHE_DTYPES"
_QUANTIZATIONS = "llmkit.core.model.quant.weight_formats:QUANTIZATIONS"


def _json_object(v: str) -> str | None:
    import json

    try:
        ok = isinstance(json.loads(v), dict)
    except ValueError:
        ok = False
    return None if ok else f"must be a JSON object (got {v!r})"


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = _model(
        None,
        "--model-path",
        "--model",
        envvar="LLMKIT_MODEL_PATH",
        help="HF model directory, .gguf file, or Hugging Face id (org/name, or org/repo:QUANT for a GGUF "
        "repository's file, as llama.cpp's -hf); default: the embedded SmolLM2-135M-Instruct.",
    )
    # A hub id's branch, tag or commit (huggingface_hub's revision); ignored for a local path.
    revision: str | None = _model(
        None,
        "--revision",
        envvar="LLMKIT_REVISION",
        help="The revision (branch, tag or commit) of a --model-path given as a Hugging Face id; default: main.",
    )
    load_format: str = _model(
        "auto",
        "--load-format",
        envvar="LLMKIT_LOAD_FORMAT",
        choices="llmkit.core.engine.stages.plan:LOAD_FORMATS",
        help="auto: load the checkpoint; dummy: random weights from config.json (benchmarks).",
    )
    model_impl: str = _model(
        "auto",
        "--model-impl",
        envvar="LLMKIT_MODEL_IMPL",
        choices="llmkit.core.engine.stages.plan:MODEL_IMPLS",
        help="auto: llmkit's own class for the architecture, else the transformers fallback (logged); "
        "llmkit: refuse an architecture without its own class; transformers: always the fallback "
        "(transformers' modeling code with llmkit's paged attention).",
    )
    # Accepted so SGLang's command lines work; logged at start, changes nothing.
    trust_remote_code: bool = _model(
        False,
        "--trust-remote-code",
        help="Accepted for SGLang compatibility; llmkit never runs code from a checkpoint "
        "(architectures come from installed plugins), so it changes nothing.",
    )
    dtype: str = _model(  # auto -> float32 on CPU (bf16 math is slow there), bfloat16 on CUDA
        "auto",
        "--dtype",
        envvar="LLMKIT_DTYPE",
        choices=_DTYPES,
        extra_choices=("auto",),
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16.",
    )
    # None: dense checkpoints dense, a GGUF at its native precision (CPU); "none": dense (a GGUF
    # dequantized); "gguf": a GGUF's own precision or an error; "int8" / "int4": weight-only,
    # quantized at load
    quantization: str | None = _model(
        None,
        "--quantization",
        envvar="LLMKIT_QUANTIZATION",
        choices=_QUANTIZATIONS,
        extra_choices=("none", "gguf"),
        generation_only=True,
        help="Weights. Default: a GGUF on CPU at its own precision (Q4_0/Q4_1/Q4_K as int4, "
        "Q8_0/Q5_K/Q6_K as int8; an explicit --dtype dequantizes), anything else dense; none: dense (a GGUF "
        "dequantized); gguf: a GGUF's own precision or an error (CPU); int8 (per channel, CPU) or int4 "
        "(grouped; CPU, or a Triton kernel on CUDA): weight-only, quantized at load.",
    )
    quantization_group_size: int | None = _model(  # int4 group size (default 32)
        None,
        "--quantization-group-size",
        envvar="LLMKIT_QUANTIZATION_GROUP_SIZE",
        check=one_of(32, 64, 128, 256),
        help="Input columns per scale for --quantization int4: 32 (default), 64, 128 or 256.",
    )
    device: str = _model("auto", "--device", envvar="LLMKIT_DEVICE", help="auto, cpu, cuda, cuda:N.")
    attention: str = _model(
        "auto",
        "--attention",
        "--attention-backend",
        envvar="LLMKIT_ATTENTION",
        plugin="attention",
        extra_choices=("auto",),
        help="Attention backend: auto, torch, triton, flashinfer, or a plugin's name.",
    )
    # A grammar plugin's name; None: the one registered as default (xgrammar); "none": disabled.
    grammar_backend: str | None = _model(
        None,
        "--grammar-backend",
        envvar="LLMKIT_GRAMMAR_BACKEND",
        plugin="grammar",
        extra_choices=("none",),
        plugin_default=True,
        help="Structured outputs: xgrammar, a plugin's backend, or none. Default: the grammar plugin "
        "registered as default.",
    )

    context_length: int | None = _sched(
        None,
        "--context-length",
        envvar="LLMKIT_CONTEXT_LENGTH",
        check=at_least(1),
        help="Override the model's context length.",
    )
    max_running_requests: int | None = _sched(  # None: 64 on CPU; on CUDA from the KV pool's size
        None,
        "--max-running-requests",
        envvar="LLMKIT_MAX_RUNNING_REQUESTS",
        check=at_least(1),
        help="Most requests decoding at once (default: 64 on CPU; on CUDA from the KV pool, 64 to 2048).",
    )
    max_queued_requests: int = _sched(
        1024,
        "--max-queued-requests",
        check=at_least(1),
        help="Requests held at once; beyond this new ones get 429.",
    )
    max_total_tokens: int | None = _sched(  # KV pool size in tokens; None: sized from memory
        None,
        "--max-total-tokens",
        envvar="LLMKIT_MAX_TOTAL_TOKENS",
        check=at_least(1),
        help="KV cache pool size in tokens (default on CPU: max(2 x context, 512 x --max-running-requests), "
        "at most 65,536 tokens or 20% of RAM; on CUDA: 0.88 of the GPU's memory less what is in use "
        "after the weights, see --mem-fraction-static).",
    )
    # SGLang's --mem-fraction-static: share of device memory for weights + KV pool (None: default sizing)
    mem_fraction_static: float | None = _sched(
        None,
        "--mem-fraction-static",
        check=fraction,
        help="Fraction of the device's memory (RAM on CPU) for weights plus the KV pool; "
        "the pool gets the rest after the weights (on CUDA after everything in use by then; "
        "default there 0.88, on CPU see --max-total-tokens). "
        "--max-total-tokens wins when both are given.",
    )
    # The KV pool's dtype (vLLM/SGLang names): auto = the model's dtype; bfloat16/float16 halve an
    # fp32 pool (CPU); fp8_e4m3/fp8_e5m2 quarter it (unscaled, saturating)
    kv_cache_dtype: str = _sched(
        "auto",
        "--kv-cache-dtype",
        envvar="LLMKIT_KV_CACHE_DTYPE",
        choices=_KV_DTYPES,
        extra_choices=("auto",),
        help="KV cache dtype: auto (the model's: fp32 on CPU), bfloat16/bf16 or float16/fp16 (half an fp32 "
        "pool: twice the tokens in the same memory), fp8_e4m3/fp8 or fp8_e5m2 (unscaled; torch backend, "
        "or triton on CUDA 8.9+).",
    )
    page_size: int = _sched(1, "--page-size", envvar="LLMKIT_PAGE_SIZE", check=at_least(1), help="Tokens per KV page.")
    chunked_prefill_size: int = _sched(
        2048,
        "--chunked-prefill-size",
        envvar="LLMKIT_CHUNKED_PREFILL_SIZE",
        check=at_least(1),
        help="Token budget per step (prefill chunks plus decode tokens).",
    )
    schedule_policy: str = _sched(
        "fcfs",
        "--schedule-policy",
        envvar="LLMKIT_SCHEDULE_POLICY",
        choices="llmkit.core.engine.scheduler:SCHEDULE_POLICIES",
        help="fcfs or lpm (longest prefix match first).",
    )
    disable_radix_cache: bool = _sched(
        False, "--disable-radix-cache", envvar="LLMKIT_DISABLE_RADIX_CACHE", help="Turn off prefix sharing."
    )
    # The storage tier under the radix cache (core/kvcache/storage_tier.py; SGLang's HiCache names)
    enable_hierarchical_cache: bool = _sched(
        False,
        "--enable-hierarchical-cache",
        envvar="LLMKIT_ENABLE_HIERARCHICAL_CACHE",
        help="Keep prefixes the radix cache computed in a storage tier too (files by default), so a "
        "prefix evicted from the pool, or computed before a restart or by another replica sharing the "
        "store, is loaded instead of recomputed.",
    )
    hicache_storage_backend: str | None = _sched(
        None,
        "--hicache-storage-backend",
        envvar="LLMKIT_HICACHE_STORAGE_BACKEND",
        plugin="kv_storage",
        help="The storage tier's backend: file, redis, s3, or a plugin's; setting it turns the tier on. "
        "Default with --enable-hierarchical-cache: the one registered as default (file).",
    )
    hicache_storage_path: str = _sched(
        "llmkit_kv_cache",
        "--hicache-storage-path",
        envvar="LLMKIT_HICACHE_STORAGE_PATH",
        help="The file backend's folder (llmkit's own option); servers sharing it share prefixes.",
    )
    hicache_storage_backend_extra_config: str | None = _sched(
        None,
        "--hicache-storage-backend-extra-config",
        envvar="LLMKIT_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG",
        check=lambda v: _json_object(v),
        help='The backend\'s settings as a JSON object, e.g. redis: \'{"url": "redis://127.0.0.1:6379/0"}\', '
        's3: \'{"bucket": "B", "endpoint_url": "http://..."}\'.',
    )
    hicache_write_policy: str = _sched(
        "write_through",
        "--hicache-write-policy",
        choices=("write_through", "write_back"),
        help="When K/V reaches the storage tier (off the engine step; a full write queue drops the write): "
        "write_through, when a request leaves; write_back, when its pages are evicted from the pool (fewer "
        "writes; copied out as they are evicted, and at shutdown).",
    )
    hicache_prefetch_timeout: float = _sched(
        2.0,
        "--hicache-prefetch-timeout",
        check=lambda v: None if v >= 0 else f"must be 0 or more (got {v})",
        help="Seconds a request waits in the queue for its prefix from the storage tier; then it runs "
        "with what arrived (the rest is computed).",
    )
    # Hybrid models (Qwen3.5's Gated DeltaNet layers): their recurrent state exists only where a
    # request's computation stopped, so the prefix cache keeps snapshots of it (state_radix_cache.py)
    state_snapshot_interval: int = _sched(
        512,
        "--state-snapshot-interval",
        check=non_negative,
        help="Hybrid models: a prompt's state is snapshotted for the prefix cache every this many tokens "
        "(prefill chunks end there), besides at the prompt's end and when a request leaves; 0: only those.",
    )
    max_mamba_cache_size: int | None = _sched(
        None,
        "--max-mamba-cache-size",
        check=at_least(1),
        help="Hybrid models: state snapshots the prefix cache may keep (SGLang's name; default: "
        "4 x --max-running-requests, on CUDA at most what a tenth of the KV budget holds).",
    )
    # Sliding-window layers keep only the pages their window reaches (core/kvcache/window_pages.py)
    swa_full: bool = _sched(
        False,
        "--swa-full",
        envvar="LLMKIT_SWA_FULL",
        help="Sliding-window layers keep full-length K/V (llama.cpp's name): every cached prefix "
        "stays reusable, at the memory of full attention. Default: they keep only their window.",
    )
    enable_deterministic_inference: bool = _sched(
        False,
        "--enable-deterministic-inference",
        envvar="LLMKIT_DETERMINISTIC",
        help="Batch-invariant numerics: a request's output never depends on its batch.",
    )
    num_threads: int | None = _sched(
        None,
        "--num-threads",
        envvar="LLMKIT_NUM_THREADS",
        check=at_least(1),
        help="torch CPU threads (default: all cores).",
    )
    cuda_graph_max_bs: int | None = _sched(  # None: every batch size the scheduler can run (<= 256)
        None,
        "--cuda-graph-max-bs",
        envvar="LLMKIT_CUDA_GRAPH_MAX_BS",
        check=at_least(1),
        help="Largest decode batch replayed from a captured CUDA graph (default: --max-running-requests, at most 256).",
    )
    disable_cuda_graph: bool = _sched(
        False, "--disable-cuda-graph", envvar="LLMKIT_DISABLE_CUDA_GRAPH", help="Run decode steps eagerly on CUDA."
    )
    # Serve a few short requests before reporting ready (kernels compiled, graphs replayed once).
    # None: on CUDA only.
    warmup: bool | None = _sched(
        None,
        "--enable-server-warmup",
        envvar="LLMKIT_ENABLE_SERVER_WARMUP",
        help="Warm up on CPU too (on by default on CUDA): the engine's short requests, then one request of "
        "each kind through the routes, before /health answers.",
        off_flags=("--skip-server-warmup",),
        off_envvar="LLMKIT_SKIP_SERVER_WARMUP",
        off_help="Report ready without first serving a few short requests (on CUDA the warm-up compiles the "
        "kernels the first request would otherwise wait for; CPU has none).",
    )
    # Post-process step N (detokenize, stop strings, stream out) while step N+1 runs on the device.
    # None: on for CUDA (where kernels launch asynchronously), off on CPU (nothing to overlap).
    overlap_schedule: bool | None = _sched(
        None,
        "--enable-overlap-schedule",
        envvar="LLMKIT_ENABLE_OVERLAP_SCHEDULE",
        help="Overlap post-processing with the next step on CPU too (for testing; no speed-up there).",
        off_flags=("--disable-overlap-schedule",),
        off_envvar="LLMKIT_DISABLE_OVERLAP_SCHEDULE",
        off_help="Post-process each step before launching the next (overlap is on by default on CUDA).",
    )
    # Run the engine in its own process (ZeroMQ + msgpack to the server), not on a server thread;
    # data- and tensor-parallel engines always do.
    engine_process: bool = _sched(
        False,
        "--engine-process",
        envvar="LLMKIT_ENGINE_PROCESS",
        help="Run the engine in its own process (ZeroMQ + msgpack over unix sockets), so the server's Python "
        "work never shares the engine's GIL; a dead engine process fails its requests and stops the server. "
        "Always so with --dp-size or --tp-size above 1.",
    )

    # Data parallelism: this many engine processes behind one server.
    # Tensor parallelism: this many ranks share every layer; rank 0 schedules.
    tp_size: int = _par(
        1,
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        check=at_least(1),
        generation_only=True,
        help="Tensor parallelism: this many ranks (processes; one GPU each on CUDA, gloo on CPU) share every layer.",
    )
    dp_size: int = _par(
        1,
        "--dp-size",
        "--dp",
        "--data-parallel-size",
        envvar="LLMKIT_DP_SIZE",
        check=at_least(1),
        generation_only=True,
        help="Data parallelism: this many engine replicas, each in its own process, behind one server; "
        "requests go to the least loaded replica, or to the one holding their prompt's prefix.",
    )
    # Multi-node tensor parallelism (SGLang's flags): the ranks are spread evenly over nnodes nodes;
    # node 0 serves HTTP, the others run ranks only.
    nnodes: int = _par(
        1,
        "--nnodes",
        check=at_least(1),
        generation_only=True,
        help="Nodes the --tp-size ranks are spread over (node 0 serves HTTP).",
    )
    node_rank: int = _par(
        0, "--node-rank", check=non_negative, help="This node's index (0..nnodes-1); nodes > 0 run ranks only."
    )
    dist_init_addr: str | None = _par(
        None,
        "--dist-init-addr",
        "--dist-init-address",
        check=host_port,
        help="HOST:PORT where the ranks meet (torch.distributed TCP rendezvous); needed with --nnodes > 1.",
    )

    # Speculative decoding (SGLang's flags). Turns the overlap schedule off.
    speculative_algorithm: str | None = _spec(
        None,
        "--speculative-algorithm",
        plugin="speculative_algorithm",
        generation_only=True,
        help="Speculative decoding: NGRAM (draft tokens looked up in the prompt and output so far), "
        "STANDALONE (a draft model), EAGLE / EAGLE3 (EAGLE-1/2, EAGLE-3 draft heads), MTP (DeepSeek-V3's "
        "own MTP layer), or a plugin's name; the output is unchanged, only faster where the draft is right.",
    )
    speculative_num_draft_tokens: int = _spec(
        4,
        "--speculative-num-draft-tokens",
        check=at_least(1),
        help="Most draft tokens a request verifies per step (each step emits up to this + 1 tokens).",
    )
    # SGLang's EAGLE flags: the chain's length (given: it decides the draft length, as SGLang
    # sets num_draft_tokens = num_steps + 1 at top-k 1) and the candidates a step (1: a chain)
    speculative_num_steps: int | None = _spec(
        None,
        "--speculative-num-steps",
        check=at_least(1),
        help="SGLang's draft depth: given, the most draft tokens a step (in place of "
        "--speculative-num-draft-tokens, as SGLang uses num_steps + 1 verified tokens at top-k 1).",
    )
    speculative_eagle_topk: int | None = _spec(
        None,
        "--speculative-eagle-topk",
        check=at_least(1),
        help="SGLang's candidates per draft step: 1 (one chain), or more for a tree of candidates verified "
        "in one forward (at most --speculative-num-draft-tokens nodes, --speculative-num-steps deep).",
    )
    speculative_draft_model_path: str | None = _spec(
        None,
        "--speculative-draft-model-path",
        help="STANDALONE: the draft model (a smaller model with the same tokenizer); EAGLE, EAGLE3: the "
        "head's directory; MTP: where the MTP layer is, if not in the target's.",
    )
    speculative_draft_device: str | None = _spec(
        None,
        "--speculative-draft-device",
        help="STANDALONE: the device the draft model runs on (cpu, cuda, cuda:N) when not the target's, e.g. "
        "cpu to leave the GPU's memory to the target. The heads (EAGLE, EAGLE3, MTP) run on the target's.",
    )
    speculative_ngram_min_match_window_size: int = _spec(
        2,
        "--speculative-ngram-min-match-window-size",
        check=at_least(1),
        help="NGRAM: the fewest trailing tokens that must match an earlier place to draft from it.",
    )
    speculative_ngram_max_match_window_size: int = _spec(
        4,
        "--speculative-ngram-max-match-window-size",
        check=at_least(1),
        help="NGRAM: the most trailing tokens matched (the longest match wins).",
    )

    # LoRA adapters (SGLang's and vLLM's flags): on when any is given or enable_lora is set
    # (run-time loading only; the server's --lora-dir and --lora-resolver set it too)
    lora_paths: tuple[str, ...] = _lora(
        (),
        "--lora-paths",
        "--lora-modules",
        nargs=True,
        generation_only=True,
        help="LoRA adapters served from the start, name=path (PEFT directories); several may follow "
        "one flag. A request picks one with model: <name> (or lora_path).",
    )
    enable_lora: bool = _lora(
        False,
        "--enable-lora",
        generation_only=True,
        help="Serve LoRA adapters loaded at run time (POST /load_lora_adapter) with none given at start.",
    )
    max_loras_per_batch: int = _lora(
        8,
        "--max-loras-per-batch",
        check=at_least(1),
        help="Distinct LoRA adapters one batch mixes (requests of others wait their turn).",
    )
    max_lora_rank: int = _lora(64, "--max-lora-rank", check=at_least(1), help="The largest LoRA rank accepted.")
    lora_target_modules: tuple[str, ...] = _lora(  # empty: all seven
        (),
        "--lora-target-modules",
        nargs=True,
        help="Projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
        "or all (the default).",
    )

    # Not options: how often the engine logs decode throughput, and which data-parallel replica
    # this engine is (set per replica).
    decode_log_interval: int = 40
    dp_rank: int = 0
