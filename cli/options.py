"""Reusable option aliases (names follow SGLang's where one exists)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelPath = Annotated[
    Optional[str],
    typer.Option(
        "--model-path",
        "--model",
        envvar="LLMKIT_MODEL_PATH",
        help="HF model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.",
    ),
]
Attention = Annotated[
    str,
    typer.Option(
        "--attention",
        "--attention-backend",
        envvar="LLMKIT_ATTENTION",
        help="Attention backend: auto, torch, triton, flashinfer, or a plugin's name.",
    ),
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype", envvar="LLMKIT_DTYPE", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16."
    ),
]
KvCacheDtype = Annotated[
    str,
    typer.Option(
        "--kv-cache-dtype",
        envvar="LLMKIT_KV_CACHE_DTYPE",
        help="KV cache dtype: auto (the model's: fp32 on CPU), bfloat16/bf16 or float16/fp16 (half an fp32 "
        "pool: twice the tokens in the same memory), fp8_e4m3/fp8 or fp8_e5m2 (unscaled; torch backend, "
        "or triton on CUDA 8.9+).",
    ),
]
Device = Annotated[str, typer.Option("--device", envvar="LLMKIT_DEVICE", help="auto, cpu, cuda, cuda:N.")]
ContextLength = Annotated[
    Optional[int],
    typer.Option("--context-length", envvar="LLMKIT_CONTEXT_LENGTH", help="Override the model's context length."),
]
MaxRunning = Annotated[
    Optional[int],
    typer.Option(
        "--max-running-requests",
        envvar="LLMKIT_MAX_RUNNING_REQUESTS",
        help="Most requests decoding at once (default: 64 on CPU; on CUDA from the KV pool, 64 to 2048).",
    ),
]
MaxTotalTokens = Annotated[
    Optional[int],
    typer.Option(
        "--max-total-tokens",
        envvar="LLMKIT_MAX_TOTAL_TOKENS",
        help="KV cache pool size in tokens (default on CPU: max(2 x context, 512 x --max-running-requests), "
        "at most 65,536 tokens or 20% of RAM; on CUDA: 0.88 of the GPU's memory less what is in use "
        "after the weights, see --mem-fraction-static).",
    ),
]
ChunkedPrefill = Annotated[
    int,
    typer.Option(
        "--chunked-prefill-size",
        envvar="LLMKIT_CHUNKED_PREFILL_SIZE",
        help="Token budget per step (prefill chunks plus decode tokens).",
    ),
]
SchedulePolicy = Annotated[
    str,
    typer.Option(
        "--schedule-policy", envvar="LLMKIT_SCHEDULE_POLICY", help="fcfs or lpm (longest prefix match first)."
    ),
]
DisableRadix = Annotated[
    bool, typer.Option("--disable-radix-cache", envvar="LLMKIT_DISABLE_RADIX_CACHE", help="Turn off prefix sharing.")
]
PageSize = Annotated[int, typer.Option("--page-size", envvar="LLMKIT_PAGE_SIZE", help="Tokens per KV page.")]
Deterministic = Annotated[
    bool,
    typer.Option(
        "--enable-deterministic-inference",
        envvar="LLMKIT_DETERMINISTIC",
        help="Batch-invariant numerics: a request's output never depends on its batch.",
    ),
]
Threads = Annotated[
    Optional[int],
    typer.Option("--num-threads", envvar="LLMKIT_NUM_THREADS", help="torch CPU threads (default: all cores)."),
]
ReasoningParser = Annotated[
    Optional[str],
    typer.Option(
        "--reasoning-parser",
        envvar="LLMKIT_REASONING_PARSER",
        help="Separate reasoning_content: qwen3, deepseek-r1, ...",
    ),
]
ToolCallParser = Annotated[
    Optional[str],
    typer.Option(
        "--tool-call-parser", envvar="LLMKIT_TOOL_CALL_PARSER", help="Parse tool calls: hermes, llama3, mistral, ..."
    ),
]
ChatTemplate = Annotated[
    Optional[str],
    typer.Option(
        "--chat-template", envvar="LLMKIT_CHAT_TEMPLATE", help="A Jinja chat template file overriding the tokenizer's."
    ),
]
GrammarBackend = Annotated[
    Optional[str],
    typer.Option(
        "--grammar-backend",
        envvar="LLMKIT_GRAMMAR_BACKEND",
        show_default="xgrammar",
        help="Structured outputs: xgrammar, a plugin's backend, or none. Default: the grammar plugin "
        "registered as default.",
    ),
]
CudaGraphMaxBs = Annotated[
    Optional[int],
    typer.Option(
        "--cuda-graph-max-bs",
        envvar="LLMKIT_CUDA_GRAPH_MAX_BS",
        help="Largest decode batch replayed from a captured CUDA graph (default: --max-running-requests, at most 256).",
    ),
]
DisableCudaGraph = Annotated[
    bool,
    typer.Option("--disable-cuda-graph", envvar="LLMKIT_DISABLE_CUDA_GRAPH", help="Run decode steps eagerly on CUDA."),
]
SkipServerWarmup = Annotated[
    bool,
    typer.Option(
        "--skip-server-warmup",
        envvar="LLMKIT_SKIP_SERVER_WARMUP",
        help="Report ready without first serving a few short requests (on CUDA the warm-up compiles the "
        "kernels the first request would otherwise wait for; CPU has none).",
    ),
]
Quantization = Annotated[
    Optional[str],
    typer.Option(
        "--quantization",
        envvar="LLMKIT_QUANTIZATION",
        help="Weights. Default: a GGUF on CPU at its own precision (Q4_0/Q4_1/Q4_K as int4, "
        "Q8_0/Q5_K/Q6_K as int8; an explicit --dtype dequantizes), anything else dense; none: dense (a GGUF "
        "dequantized); gguf: a GGUF's own precision or an error; int8 (per channel) or int4 (grouped): "
        "weight-only, quantized at load (CPU).",
    ),
]
QuantizationGroupSize = Annotated[
    Optional[int],
    typer.Option(
        "--quantization-group-size",
        envvar="LLMKIT_QUANTIZATION_GROUP_SIZE",
        help="Input columns per scale for --quantization int4: 32 (default), 64, 128 or 256.",
    ),
]
DisableOverlap = Annotated[
    bool,
    typer.Option(
        "--disable-overlap-schedule",
        envvar="LLMKIT_DISABLE_OVERLAP_SCHEDULE",
        help="Post-process each step before launching the next (overlap is on by default on CUDA).",
    ),
]
EnableOverlap = Annotated[
    bool,
    typer.Option(
        "--enable-overlap-schedule",
        envvar="LLMKIT_ENABLE_OVERLAP_SCHEDULE",
        help="Overlap post-processing with the next step on CPU too (for testing; no speed-up there).",
    ),
]
LoadFormat = Annotated[
    str,
    typer.Option(
        "--load-format",
        envvar="LLMKIT_LOAD_FORMAT",
        help="auto: load the checkpoint; dummy: random weights from config.json (benchmarks).",
    ),
]
EngineProcess = Annotated[
    bool,
    typer.Option(
        "--engine-process",
        envvar="LLMKIT_ENGINE_PROCESS",
        help="Run the engine in its own process (ZeroMQ + msgpack over unix sockets), so the server's Python "
        "work never shares the engine's GIL; a dead engine process fails its requests and stops the server.",
    ),
]
ServedModelName = Annotated[
    Optional[list[str]],
    typer.Option(
        "--served-model-name",
        envvar="LLMKIT_SERVED_MODEL_NAME",
        help="The model id in /v1/models (default: the model path); repeat it to add aliases requests may use. "
        "Requests naming any other model get 404.",
    ),
]
# SGLang's names, so command lines pasted from its docs work.
TpSize = Annotated[
    int,
    typer.Option(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        min=1,
        help="Tensor parallelism: this many ranks (processes; one GPU each on CUDA, gloo on CPU) share every layer.",
    ),
]
NNodes = Annotated[
    int, typer.Option("--nnodes", min=1, help="Nodes the --tp-size ranks are spread over (node 0 serves HTTP).")
]
NodeRank = Annotated[
    int, typer.Option("--node-rank", min=0, help="This node's index (0..nnodes-1); nodes > 0 run ranks only.")
]
DistInitAddr = Annotated[
    Optional[str],
    typer.Option(
        "--dist-init-addr",
        "--dist-init-address",
        help="HOST:PORT where the ranks meet (torch.distributed TCP rendezvous); needed with --nnodes > 1.",
    ),
]
DpSize = Annotated[
    int,
    typer.Option(
        "--dp-size",
        "--dp",
        "--data-parallel-size",
        envvar="LLMKIT_DP_SIZE",
        min=1,
        help="Data parallelism: this many engine replicas, each in its own process, behind one server; "
        "requests go to the least loaded replica, or to the one holding their prompt's prefix.",
    ),
]
MemFractionStatic = Annotated[
    Optional[float],
    typer.Option(
        "--mem-fraction-static",
        help="Fraction of the device's memory (RAM on CPU) for weights plus the KV pool; "
        "the pool gets the rest after the weights (on CUDA after everything in use by then; "
        "default there 0.88, on CPU see --max-total-tokens). "
        "--max-total-tokens wins when both are given.",
    ),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Accepted for SGLang compatibility; llmkit never runs code from a checkpoint "
        "(architectures come from installed plugins), so it changes nothing.",
    ),
]
DisableMetrics = Annotated[
    bool,
    typer.Option(
        "--disable-metrics", envvar="LLMKIT_DISABLE_METRICS", help="Do not serve Prometheus metrics at /metrics."
    ),
]
MetricsNoAuth = Annotated[
    bool,
    typer.Option(
        "--metrics-no-auth",
        envvar="LLMKIT_METRICS_NO_AUTH",
        help="Serve /metrics without the --api-key (for a scraper without the key).",
    ),
]
DisableWebUI = Annotated[
    bool,
    typer.Option("--disable-web-ui", envvar="LLMKIT_DISABLE_WEB_UI", help="Do not serve the chat playground at /."),
]
