"""Server configuration (frozen), beside :class:`llmkit.core.engine.config.EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = ""  # the id in /v1/models; launch fills it from the model path
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use for the model
    hf_model_id: str | None = None  # the model's Hugging Face id, accepted too; launch infers it
    # Serve a few requests through the routes before listening (launch sets it where the engine
    # warms up: on CUDA unless --skip-server-warmup)
    warm_routes: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    # SGLang's Model Gateway to register with once serving, and leave on shutdown
    # (sglang/register.py); the URL it reaches this worker at (None: from host and port)
    gateway_url: str | None = None
    gateway_worker_url: str | None = None
    api_keys: tuple[str, ...] = ()  # --api-key, repeatable (access/keys.py: a lone one is the admin)
    api_keys_file: str | None = None  # one key a line, with a name, a role and limits (access/keys.py)
    rate_limit_rpm: int = 0  # requests per minute per key (0: none); the keys file may override it
    rate_limit_tpm: int = 0  # tokens per minute per key, counted as generations finish (0: none)
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's template
    reasoning_parser: str | None = None
    # The sampling defaults of a request that leaves a field out (generation/sampling_defaults.py),
    # as vLLM's --generation-config: auto (the model's generation_config.json), vllm or none (the
    # neutral values, the file ignored), or a path (a directory holding generation_config.json, or the file)
    generation_config: str = "auto"
    tool_call_parser: str | None = None
    max_payload_size: int = 32 << 20  # every route's body cap (413), enforced while reading
    max_upload_size: int = 200 << 20  # POST /v1/files bodies (batch input files, as OpenAI's cap)
    max_prompt_list: int = 256
    # LoRA adapters named in a request but not loaded are looked up as <lora_dir>/<name> and loaded
    # on first use; past max_loaded_loras the least recently used adapter is unloaded (None: no limit)
    lora_dir: str | None = None
    lora_resolver: str | None = None  # a resolver plugin's name (None: "dir" when lora_dir is set)
    max_loaded_loras: int | None = None
    # Serve the model as an embedding model (SGLang's --is-embedding); launch also sets it where
    # the config names an encoder architecture
    is_embedding: bool = False
    is_reranker: bool = False  # serve a causal LM as a yes/no reranker (Qwen3-Reranker style)
    rerank_instruction: str | None = None  # its prompt's <Instruct> (None: the model card's)
    pooler_config: str | None = None  # vLLM's JSON overriding an embedding model's pooling
    max_embedding_inputs: int = 2048  # inputs in one /v1/embeddings request (OpenAI's cap)
    # Images (vision-language models): where they may come from and how big (multimodal/media.py)
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name (none: no fetching)
    allowed_local_media_path: str | None = None  # the directory file: image URLs may name
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 16
    media_fetch_timeout: float = 10.0
    max_prompt_size: int = 16 << 20  # characters; longer prompts are refused before tokenizing
    max_system_blocks: int = 256  # an Anthropic system's blocks (10,000 cost 8.5 s)
    max_prompt_logprobs_tokens: int = 1024  # prompt logprobs are a vocab-wide softmax per token
    stream_include_usage_default: bool = False
    shutdown_timeout: int = 30
    max_connections: int | None = None  # open connections accepted (None: from the descriptor limit)
    header_timeout: float = 10.0  # seconds to send a request's headers (slow-header connections close)
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    queue_timeout: float = 600.0  # seconds an HTTP request may wait for the engine before a 503 (0: no limit)
    health_stall_timeout: float = 300.0  # /health is 503 once the engine shows no progress this long
    log_level: str = "info"
    # Files & Batches: a storage plugin's name (None: the one registered as default, local).
    enable_batches: bool = True
    batch_storage: str | None = None
    file_storage_path: str = "./llmkit_storage"
    storage_options: tuple[str, ...] = ()  # KEY=VALUE pairs for the storage backend
    batch_max_in_flight: int = 4
    batch_lease_ttl: float = 30.0  # seconds a replica's batch lease lasts unrenewed
    enable_metrics: bool = True  # GET /metrics (Prometheus)
    metrics_no_auth: bool = False  # serve /metrics without the API key
    enable_web_ui: bool = True  # the chat playground at /
