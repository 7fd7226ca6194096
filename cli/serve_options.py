"""Every ``llmkit serve`` option, declared once: its flags (SGLang's names where one exists, so
command lines pasted from its docs work), envvar, type, default, help, and the config field it
fills. ``serve``'s parameters and :func:`build_configs` are generated from this table."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.media_options import MEDIA_OPTIONS
from llmkit.cli.option_table import ServeOption, accepted_only, config_fields, negated, only_when_given


def _served_names(names, _) -> dict:
    # The first name is the id in /v1/models (empty: launch uses the model path); the rest are aliases.
    return {
        "server.served_model_name": (names or [""])[0],
        "server.served_model_aliases": tuple((names or [])[1:]),
    }


def _api_keys(keys, _) -> dict:
    return {"server.api_keys": tuple(keys or ())}


def _batch_storage(name, _) -> dict:
    return {"server.enable_batches": name != "none", "server.batch_storage": None if name == "none" else name}


def _engine_process(given, p) -> dict:
    # Data- and tensor-parallel engines always run in processes of their own.
    return {"engine.engine_process": given or p["dp_size"] > 1 or p["tp_size"] > 1}


SERVE_OPTIONS = (
    ServeOption(
        ("--model-path", "--model"),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_MODEL_PATH",
        help="HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.",
    ),
    ServeOption(("--host",), str, "127.0.0.1", to="server", envvar="LLMKIT_HOST"),
    ServeOption(("--port",), int, 30000, to="server", envvar="LLMKIT_PORT"),
    ServeOption(
        ("--gateway-url",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_GATEWAY_URL",
        help="SGLang's Model Gateway (sglang-router) to join: once serving, this worker registers itself there "
        "(retrying until the gateway answers; --api-key is sent as the gateway's key too) and leaves on SIGTERM.",
    ),
    ServeOption(
        ("--gateway-worker-url",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_GATEWAY_WORKER_URL",
        help="The URL the gateway reaches this worker at. Default: http://HOST:PORT, with --host 0.0.0.0 or :: "
        "replaced by the address this machine's host name resolves to; give it behind NAT.",
    ),
    ServeOption(
        ("--served-model-name",),
        Optional[list[str]],
        None,
        to=_served_names,
        envvar="LLMKIT_SERVED_MODEL_NAME",
        help="The model id in /v1/models (default: the model path); repeat it to add aliases requests may use. "
        "The model's Hugging Face id is accepted too when its path or config names it. "
        "Requests naming any other model get 404.",
    ),
    ServeOption(
        ("--chat-template",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_CHAT_TEMPLATE",
        help="A Jinja chat template file overriding the tokenizer's.",
    ),
    ServeOption(
        ("--attention", "--attention-backend"),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_ATTENTION",
        help="Attention backend: auto, torch, triton, flashinfer, or a plugin's name.",
    ),
    ServeOption(
        ("--reasoning-parser",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_REASONING_PARSER",
        help="Separate reasoning_content: qwen3, deepseek-r1, ...",
    ),
    ServeOption(
        ("--tool-call-parser",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_TOOL_CALL_PARSER",
        help="Parse tool calls: hermes, llama3, mistral, ...",
    ),
    ServeOption(
        ("--grammar-backend",),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_GRAMMAR_BACKEND",
        help="Structured outputs: xgrammar, a plugin's backend, or none. Default: the grammar plugin "
        "registered as default.",
        typer_args={"show_default": "xgrammar"},
    ),
    ServeOption(
        ("--dtype",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_DTYPE",
        help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16.",
    ),
    ServeOption(
        ("--kv-cache-dtype",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_KV_CACHE_DTYPE",
        help="KV cache dtype: auto (the model's: fp32 on CPU), bfloat16/bf16 or float16/fp16 (half an fp32 "
        "pool: twice the tokens in the same memory), fp8_e4m3/fp8 or fp8_e5m2 (unscaled; torch backend, "
        "or triton on CUDA 8.9+).",
    ),
    ServeOption(("--device",), str, "auto", to="engine", envvar="LLMKIT_DEVICE", help="auto, cpu, cuda, cuda:N."),
    ServeOption(
        ("--api-key",),
        Optional[list[str]],
        None,
        to=_api_keys,
        envvar="LLMKIT_API_KEY",
        help="Require 'Authorization: Bearer KEY' (or x-api-key) except on /health; repeat it for several keys, "
        "each seeing only the files, batches and responses it made (a lone --api-key sees everything).",
    ),
    ServeOption(
        ("--api-keys-file",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_API_KEYS_FILE",
        help="A file of keys, one a line: KEY [NAME] [admin] [rpm=N] [tpm=N]; '#' comments. Each key sees only "
        "what it made; admin keys see everything.",
    ),
    ServeOption(
        ("--rate-limit-rpm",),
        int,
        0,
        to="server",
        envvar="LLMKIT_RATE_LIMIT_RPM",
        help="Requests per minute per key (0: no limit); over it a 429 with Retry-After.",
    ),
    ServeOption(
        ("--rate-limit-tpm",),
        int,
        0,
        to="server",
        envvar="LLMKIT_RATE_LIMIT_TPM",
        help="Tokens (prompt + completion, counted as each generation ends) per minute per key (0: no limit).",
    ),
    ServeOption(
        ("--context-length",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_CONTEXT_LENGTH",
        help="Override the model's context length.",
    ),
    ServeOption(
        ("--max-running-requests",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_MAX_RUNNING_REQUESTS",
        help="Most requests decoding at once (default: 64 on CPU; on CUDA from the KV pool, 64 to 2048).",
    ),
    ServeOption(
        ("--max-queued-requests",),
        int,
        1024,
        to="engine",
        help="Requests held at once; beyond this new ones get 429.",
    ),
    ServeOption(
        ("--max-total-tokens",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_MAX_TOTAL_TOKENS",
        help="KV cache pool size in tokens (default on CPU: max(2 x context, 512 x --max-running-requests), "
        "at most 65,536 tokens or 20% of RAM; on CUDA: 0.88 of the GPU's memory less what is in use "
        "after the weights, see --mem-fraction-static).",
    ),
    ServeOption(
        ("--chunked-prefill-size",),
        int,
        2048,
        to="engine",
        envvar="LLMKIT_CHUNKED_PREFILL_SIZE",
        help="Token budget per step (prefill chunks plus decode tokens).",
    ),
    ServeOption(
        ("--schedule-policy",),
        str,
        "fcfs",
        to="engine",
        envvar="LLMKIT_SCHEDULE_POLICY",
        help="fcfs or lpm (longest prefix match first).",
    ),
    ServeOption(
        ("--disable-radix-cache",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DISABLE_RADIX_CACHE",
        help="Turn off prefix sharing.",
    ),
    ServeOption(("--page-size",), int, 1, to="engine", envvar="LLMKIT_PAGE_SIZE", help="Tokens per KV page."),
    ServeOption(
        ("--enable-deterministic-inference",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DETERMINISTIC",
        help="Batch-invariant numerics: a request's output never depends on its batch.",
    ),
    ServeOption(
        ("--num-threads",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_NUM_THREADS",
        help="torch CPU threads (default: all cores).",
    ),
    ServeOption(
        ("--quantization",),
        Optional[str],
        None,
        to="engine",
        envvar="LLMKIT_QUANTIZATION",
        help="Weights. Default: a GGUF on CPU at its own precision (Q4_0/Q4_1/Q4_K as int4, "
        "Q8_0/Q5_K/Q6_K as int8; an explicit --dtype dequantizes), anything else dense; none: dense (a GGUF "
        "dequantized); gguf: a GGUF's own precision or an error; int8 (per channel) or int4 (grouped): "
        "weight-only, quantized at load (CPU).",
    ),
    ServeOption(
        ("--quantization-group-size",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_QUANTIZATION_GROUP_SIZE",
        help="Input columns per scale for --quantization int4: 32 (default), 64, 128 or 256.",
    ),
    ServeOption(
        ("--cuda-graph-max-bs",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_CUDA_GRAPH_MAX_BS",
        help="Largest decode batch replayed from a captured CUDA graph (default: --max-running-requests, at most 256).",
    ),
    ServeOption(
        ("--disable-cuda-graph",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DISABLE_CUDA_GRAPH",
        help="Run decode steps eagerly on CUDA.",
    ),
    ServeOption(
        ("--skip-server-warmup",),
        bool,
        False,
        to=only_when_given("engine.warmup", False),
        envvar="LLMKIT_SKIP_SERVER_WARMUP",
        help="Report ready without first serving a few short requests (on CUDA the warm-up compiles the "
        "kernels the first request would otherwise wait for; CPU has none).",
    ),
    ServeOption(
        ("--enable-server-warmup",),
        bool,
        False,
        to=only_when_given("engine.warmup", True),
        envvar="LLMKIT_ENABLE_SERVER_WARMUP",
        help="Warm up on CPU too (on by default on CUDA): the engine's short requests, then one request of "
        "each kind through the routes, before /health answers.",
    ),
    ServeOption(
        ("--disable-overlap-schedule",),
        bool,
        False,
        to=only_when_given("engine.overlap_schedule", False),
        envvar="LLMKIT_DISABLE_OVERLAP_SCHEDULE",
        help="Post-process each step before launching the next (overlap is on by default on CUDA).",
    ),
    ServeOption(
        ("--enable-overlap-schedule",),
        bool,
        False,
        to=only_when_given("engine.overlap_schedule", True),
        envvar="LLMKIT_ENABLE_OVERLAP_SCHEDULE",
        help="Overlap post-processing with the next step on CPU too (for testing; no speed-up there).",
    ),
    ServeOption(
        ("--speculative-algorithm",),
        Optional[str],
        None,
        to="engine",
        help="Speculative decoding: NGRAM (draft tokens looked up in the prompt and output so far), "
        "STANDALONE (a draft model), EAGLE / EAGLE3 (EAGLE-1/2, EAGLE-3 draft heads), MTP (DeepSeek-V3's "
        "own MTP layer), "
        "or a plugin's name; the output is "
        "unchanged, only faster where the draft is right.",
    ),
    ServeOption(
        ("--speculative-num-draft-tokens",),
        int,
        4,
        to="engine",
        help="Most draft tokens a request verifies per step (each step emits up to this + 1 tokens).",
    ),
    ServeOption(
        ("--speculative-num-steps",),
        Optional[int],
        None,
        to="engine",
        help="SGLang's draft depth: given, the most draft tokens a step (in place of "
        "--speculative-num-draft-tokens, as SGLang uses num_steps + 1 verified tokens at top-k 1).",
    ),
    ServeOption(
        ("--speculative-eagle-topk",),
        Optional[int],
        None,
        to="engine",
        help="SGLang's candidates per draft step: 1 (one chain) only; tree drafts are not supported yet.",
    ),
    ServeOption(
        ("--speculative-draft-model-path",),
        Optional[str],
        None,
        to="engine",
        help="STANDALONE: the draft model (a smaller model with the same tokenizer); EAGLE, EAGLE3: the "
        "head's directory; MTP: where the MTP layer is, if not in the target's. Run on the target's device.",
    ),
    ServeOption(
        ("--speculative-ngram-min-match-window-size",),
        int,
        2,
        to="engine",
        help="NGRAM: the fewest trailing tokens that must match an earlier place to draft from it.",
    ),
    ServeOption(
        ("--speculative-ngram-max-match-window-size",),
        int,
        4,
        to="engine",
        help="NGRAM: the most trailing tokens matched (the longest match wins).",
    ),
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
    ServeOption(
        ("--load-format",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_LOAD_FORMAT",
        help="auto: load the checkpoint; dummy: random weights from config.json (benchmarks).",
    ),
    ServeOption(("--max-payload-size",), int, 32 << 20, to="server", help="Request body cap in bytes."),
    ServeOption(
        ("--shutdown-timeout",),
        int,
        30,
        to="server",
        help="Seconds to drain in-flight requests after SIGTERM (those left then get 503; "
        "a second SIGTERM exits at once).",
    ),
    ServeOption(
        ("--max-prompt-size",),
        int,
        16 << 20,
        to="server",
        help="Prompt cap in characters, checked before tokenizing.",
    ),
    ServeOption(
        ("--max-system-blocks",),
        int,
        256,
        to="server",
        help="Content blocks an Anthropic system prompt may have.",
    ),
    ServeOption(
        ("--max-prompt-logprobs-tokens",),
        int,
        1024,
        to="server",
        help="Prompt tokens one request may ask prompt logprobs for (echo, /generate).",
    ),
    ServeOption(
        ("--queue-timeout",),
        float,
        600.0,
        to="server",
        help="Seconds a request may wait for the engine before a 503 (0: no limit).",
    ),
    ServeOption(
        ("--health-stall-timeout",),
        float,
        300.0,
        to="server",
        help="Seconds without engine progress (a step that never ends, a frozen engine process) after "
        "which /health answers 503.",
    ),
    ServeOption(
        ("--max-connections",),
        Optional[int],
        None,
        to="server",
        help="Open connections accepted at once; a new one beyond is closed at once "
        "(default: the descriptor limit less 256, at most 16384).",
    ),
    ServeOption(
        ("--header-timeout",),
        float,
        10.0,
        to="server",
        help="Seconds a connection has to send a request's headers before it is closed.",
    ),
    ServeOption(
        ("--keep-alive-timeout",),
        float,
        5.0,
        to="server",
        help="Seconds an idle keep-alive connection stays open.",
    ),
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
    ServeOption(("--log-level",), str, "info", to="server"),
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
    ServeOption(
        ("--mem-fraction-static",),
        Optional[float],
        None,
        to="engine",
        help="Fraction of the device's memory (RAM on CPU) for weights plus the KV pool; "
        "the pool gets the rest after the weights (on CUDA after everything in use by then; "
        "default there 0.88, on CPU see --max-total-tokens). "
        "--max-total-tokens wins when both are given.",
    ),
    ServeOption(
        ("--trust-remote-code",),
        bool,
        False,
        to=accepted_only,  # llmkit never runs a checkpoint's code: no config field
        help="Accepted for SGLang compatibility; llmkit never runs code from a checkpoint "
        "(architectures come from installed plugins), so it changes nothing.",
    ),
    ServeOption(
        ("--disable-metrics",),
        bool,
        False,
        to=negated("server.enable_metrics"),
        envvar="LLMKIT_DISABLE_METRICS",
        help="Do not serve Prometheus metrics at /metrics.",
    ),
    ServeOption(
        ("--metrics-no-auth",),
        bool,
        False,
        to="server",
        envvar="LLMKIT_METRICS_NO_AUTH",
        help="Serve /metrics without the --api-key (for a scraper without the key).",
    ),
    ServeOption(
        ("--disable-web-ui",),
        bool,
        False,
        to=negated("server.enable_web_ui"),
        envvar="LLMKIT_DISABLE_WEB_UI",
        help="Do not serve the chat playground at /.",
    ),
    ServeOption(
        ("--engine-process",),
        bool,
        False,
        to=_engine_process,
        envvar="LLMKIT_ENGINE_PROCESS",
        help="Run the engine in its own process (ZeroMQ + msgpack over unix sockets), so the server's Python "
        "work never shares the engine's GIL; a dead engine process fails its requests and stops the server.",
    ),
    ServeOption(
        ("--is-embedding",),
        bool,
        False,
        to="server",
        envvar="LLMKIT_IS_EMBEDDING",
        help="Serve the model at /v1/embeddings (an encoder such as BertModel is recognised from its "
        "config without it; a causal LM embeds its last token, Qwen3-Embedding style); generation "
        "routes then answer 400.",
    ),
    ServeOption(
        ("--is-reranker",),
        bool,
        False,
        to="server",
        envvar="LLMKIT_IS_RERANKER",
        help="Serve a causal LM as a yes/no reranker (Qwen3-Reranker style) at /v1/rerank and /v1/score; "
        "cross-encoders (BertForSequenceClassification) are recognised from their config without it.",
    ),
    ServeOption(
        ("--rerank-instruction",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_RERANK_INSTRUCTION",
        help="The <Instruct> of an --is-reranker model's prompt (default: Qwen3-Reranker's, for web search).",
    ),
    ServeOption(
        ("--pooler-config",),
        Optional[str],
        None,
        to="server",
        envvar="LLMKIT_POOLER_CONFIG",
        help="An embedding model's pooling over what its files say, as vLLM's JSON: "
        '{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true | false}.',
    ),
    ServeOption(
        ("--max-embedding-inputs",),
        int,
        2048,
        to="server",
        envvar="LLMKIT_MAX_EMBEDDING_INPUTS",
        help="The most inputs one /v1/embeddings request (documents of a /v1/rerank, pairs of a "
        "/v1/score) may carry (OpenAI's cap: 2048).",
    ),
) + MEDIA_OPTIONS


def build_configs(params: dict):
    """The engine and server configs from ``llmkit serve``'s options (``ctx.params``: every row's
    value by name), checked first by ``check_serve_options``."""
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.server.config import ServerConfig

    engine, server = config_fields(SERVE_OPTIONS, params)
    return EngineConfig(**engine), ServerConfig(**server)
