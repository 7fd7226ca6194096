"""Engine configuration (frozen)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto -> float32 on CPU (bf16 math is slow there), bfloat16 on CUDA
    device: str = "auto"
    attention: str = "auto"
    # The KV pool's dtype (vLLM/SGLang names): auto = the model's dtype; bfloat16/float16 halve an
    # fp32 pool (CPU); fp8_e4m3/fp8_e5m2 quarter it (unscaled, saturating)
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None: sized from memory
    max_running_requests: int | None = None  # None: 64 on CPU; on CUDA from the KV pool's size
    max_queued_requests: int = 1024
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    context_length: int | None = None
    enable_deterministic_inference: bool = False
    num_threads: int | None = None
    decode_log_interval: int = 40
    # None: dense checkpoints dense, a GGUF at its native precision (CPU); "none": dense (a GGUF
    # dequantized); "int8" / "int4": weight-only, quantized at load (CPU)
    quantization: str | None = None
    quantization_group_size: int | None = None  # int4 group size (default 32)
    cuda_graph_max_bs: int | None = None  # None: every batch size the scheduler can run (<= 256)
    disable_cuda_graph: bool = False
    # Serve a few short requests before reporting ready (kernels compiled, graphs replayed once).
    # None: on CUDA only (SGLang's --skip-server-warmup turns it off).
    warmup: bool | None = None
    # Post-process step N (detokenize, stop strings, stream out) while step N+1 runs on the device.
    # None: on for CUDA (where kernels launch asynchronously), off on CPU (nothing to overlap).
    overlap_schedule: bool | None = None
    # Speculative decoding (SGLang's flags): an algorithm plugin's name (None: off), the most draft
    # tokens a request verifies per step, and NGRAM's match window (tokens of the sequence's end
    # looked up earlier in it, the longest first). Turns the overlap schedule off.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    # SGLang's EAGLE flags: the chain's length (given: it decides the draft length, as SGLang
    # sets num_draft_tokens = num_steps + 1 at top-k 1) and the candidates a step (1: a chain)
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_path: str | None = None  # STANDALONE's draft model
    # where a draft model runs when not on the target's device (None: the target's), e.g. "cpu" to
    # keep a GPU's memory for the target
    speculative_draft_device: str | None = None
    speculative_ngram_min_match_window_size: int = 2
    speculative_ngram_max_match_window_size: int = 4
    # A grammar plugin's name; None: the one registered as default (xgrammar); "none": disabled.
    grammar_backend: str | None = None
    # Run the engine in its own process (ZeroMQ + msgpack to the server), not on a server thread.
    engine_process: bool = False
    # Data parallelism: this many engine processes behind one server (implies engine_process).
    dp_size: int = 1
    # Tensor parallelism: this many ranks share every layer (implies engine_process); rank 0 schedules.
    tp_size: int = 1
    # Multi-node tensor parallelism (SGLang's flags): the ranks are spread evenly over nnodes nodes;
    # node 0 serves HTTP, the others run ranks only. dist_init_addr: HOST:PORT of the rendezvous.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dp_rank: int = 0  # which data-parallel replica this engine is (set per replica)
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights (benchmarks)
    # LoRA adapters (SGLang's and vLLM's flags): "name=path" served from the start; on when any is
    # given or enable_lora is set (run-time loading only); the distinct adapters one batch mixes,
    # the largest rank, and the checkpoint modules adapters may target (empty: all seven)
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: tuple[str, ...] = ()
    # SGLang's --mem-fraction-static: share of device memory for weights + KV pool (None: default sizing)
    mem_fraction_static: float | None = None
