"""Server configuration (frozen), beside :class:`llmkit.core.engine.config.EngineConfig`. Each
field a user may set is a serve option, declared here once (``core/option.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from llmkit.core.option import at_least, http_url, non_negative, option, port, positive

_model = partial(option, panel="Model and kernels")
_http = partial(option, panel="HTTP server and limits")
_lora = partial(option, panel="LoRA adapters")
_batch = partial(option, panel="Batches and storage")
_embed = partial(option, panel="Embeddings and rerank")
_media = partial(option, panel="Images")
_audio = partial(option, panel="Audio")


def _served_names(names) -> dict:
    # The first name is the id in /v1/models (empty: launch uses the model path); the rest are aliases.
    return {"served_model_name": (names or [""])[0], "served_model_aliases": tuple((names or [])[1:])}


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str = _model(  # the id in /v1/models; launch fills it from the model path
        "",
        "--served-model-name",
        envvar="LLMKIT_SERVED_MODEL_NAME",
        show_default="the model path",
        spread=_served_names,
        cli_type=Optional[list[str]],
        help="The model id in /v1/models (default: the model path); repeat it to add aliases requests may use. "
        "The model's Hugging Face id is accepted too when its path or config names it. "
        "Requests naming any other model get 404.",
    )
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use (--served-model-name)
    chat_template: str | None = _model(
        None,
        "--chat-template",
        envvar="LLMKIT_CHAT_TEMPLATE",
        help="A Jinja chat template file overriding the tokenizer's.",
    )
    # The sampling defaults of a request that leaves a field out (generation/sampling_defaults.py),
    # as vLLM's --generation-config
    generation_config: str = _model(
        "auto",
        "--generation-config",
        envvar="LLMKIT_GENERATION_CONFIG",
        generation_only=True,
        help="Sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, "
        "repetition_penalty), on every route: auto: the model's generation_config.json; vllm (or none): "
        "the neutral values, the file ignored; a path: a directory holding generation_config.json, or the file.",
    )
    reasoning_parser: str | None = _model(
        None,
        "--reasoning-parser",
        envvar="LLMKIT_REASONING_PARSER",
        plugin="reasoning_parser",
        generation_only=True,
        help="Separate reasoning_content: qwen3, deepseek-r1, ...",
    )
    tool_call_parser: str | None = _model(
        None,
        "--tool-call-parser",
        envvar="LLMKIT_TOOL_CALL_PARSER",
        plugin="tool_parser",
        generation_only=True,
        help="Parse tool calls: hermes, llama3, mistral, ...",
    )
    strict_tool_calls: bool = _model(
        True,
        "--disable-strict-tool-calls",
        negate=True,
        envvar="LLMKIT_DISABLE_STRICT_TOOL_CALLS",
        generation_only=True,
        help='Leave tool_choice "auto" calls unconstrained (only tools sent with strict: true keep their '
        "schema). By default every call the model opens is held to its tool's schema in the tool-call "
        "parser's format, where the parser declares one.",
    )

    host: str = _http("127.0.0.1", "--host", envvar="LLMKIT_HOST", help="The address to listen on.")
    port: int = _http(30000, "--port", envvar="LLMKIT_PORT", check=port, help="The port to listen on.")
    log_level: str = _http(
        "info",
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="How much to log.",
    )
    api_keys: tuple[str, ...] = _http(  # access/keys.py: a lone one is the admin
        (),
        "--api-key",
        envvar="LLMKIT_API_KEY",
        help="Require 'Authorization: Bearer KEY' (or x-api-key) except on /health; repeat it for several keys, "
        "each seeing only the files, batches and responses it made (a lone --api-key sees everything).",
    )
    api_keys_file: str | None = _http(  # one key a line, with a name, a role and limits (access/keys.py)
        None,
        "--api-keys-file",
        envvar="LLMKIT_API_KEYS_FILE",
        help="A file of keys, one a line: KEY [NAME] [admin] [rpm=N] [tpm=N]; '#' comments. Each key sees only "
        "what it made; admin keys see everything.",
    )
    rate_limit_rpm: int = _http(  # the keys file may override it
        0,
        "--rate-limit-rpm",
        envvar="LLMKIT_RATE_LIMIT_RPM",
        check=non_negative,
        help="Requests per minute per key (0: no limit); over it a 429 with Retry-After.",
    )
    rate_limit_tpm: int = _http(
        0,
        "--rate-limit-tpm",
        envvar="LLMKIT_RATE_LIMIT_TPM",
        check=non_negative,
        help="Tokens (prompt + completion, counted as each generation ends) per minute per key (0: no limit).",
    )
    max_payload_size: int = _http(  # every route's body cap (413), enforced while reading
        32 << 20, "--max-payload-size", check=positive, help="Request body cap in bytes."
    )
    max_prompt_size: int = _http(  # longer prompts are refused before tokenizing
        16 << 20, "--max-prompt-size", check=positive, help="Prompt cap in characters, checked before tokenizing."
    )
    max_system_blocks: int = _http(  # 10,000 cost 8.5 s
        256, "--max-system-blocks", check=at_least(1), help="Content blocks an Anthropic system prompt may have."
    )
    max_prompt_logprobs_tokens: int = _http(  # prompt logprobs are a vocab-wide softmax per token
        1024,
        "--max-prompt-logprobs-tokens",
        check=at_least(1),
        help="Prompt tokens one request may ask prompt logprobs for (echo, /generate).",
    )
    queue_timeout: float = _http(
        600.0,
        "--queue-timeout",
        check=non_negative,
        help="Seconds a request may wait for the engine before a 503 (0: no limit).",
    )
    health_stall_timeout: float = _http(
        300.0,
        "--health-stall-timeout",
        check=positive,
        help="Seconds without engine progress (a step that never ends, a frozen engine process) after "
        "which /health answers 503.",
    )
    max_connections: int | None = _http(
        None,
        "--max-connections",
        check=at_least(1),
        help="Open connections accepted at once; a new one beyond is closed at once "
        "(default: the descriptor limit less 256, at most 16384).",
    )
    header_timeout: float = _http(  # slow-header connections close
        10.0,
        "--header-timeout",
        check=positive,
        help="Seconds a connection has to send a request's headers before it is closed.",
    )
    keep_alive_timeout: float = _http(
        5.0, "--keep-alive-timeout", check=positive, help="Seconds an idle keep-alive connection stays open."
    )
    shutdown_timeout: int = _http(
        30,
        "--shutdown-timeout",
        check=non_negative,
        help="Seconds to drain in-flight requests after SIGTERM (those left then get 503; "
        "a second SIGTERM exits at once).",
    )
    enable_metrics: bool = _http(  # GET /metrics (Prometheus)
        True,
        "--disable-metrics",
        negate=True,
        envvar="LLMKIT_DISABLE_METRICS",
        help="Do not serve Prometheus metrics at /metrics.",
    )
    metrics_no_auth: bool = _http(
        False,
        "--metrics-no-auth",
        envvar="LLMKIT_METRICS_NO_AUTH",
        help="Serve /metrics without the --api-key (for a scraper without the key).",
    )
    enable_web_ui: bool = _http(  # the chat playground at /
        True,
        "--disable-web-ui",
        negate=True,
        envvar="LLMKIT_DISABLE_WEB_UI",
        help="Do not serve the chat playground at /.",
    )
    # SGLang's Model Gateway to register with once serving, and leave on shutdown
    # (sglang/register.py); the URL it reaches this worker at (None: from host and port)
    gateway_url: str | None = _http(
        None,
        "--gateway-url",
        envvar="LLMKIT_GATEWAY_URL",
        check=http_url,
        help="SGLang's Model Gateway (sglang-router) to join: once serving, this worker registers itself there "
        "(retrying until the gateway answers; --api-key is sent as the gateway's key too) and leaves on SIGTERM.",
    )
    gateway_worker_url: str | None = _http(
        None,
        "--gateway-worker-url",
        envvar="LLMKIT_GATEWAY_WORKER_URL",
        check=http_url,
        help="The URL the gateway reaches this worker at. Default: http://HOST:PORT, with --host 0.0.0.0 or :: "
        "replaced by the address this machine's host name resolves to; give it behind NAT.",
    )

    # LoRA adapters named in a request but not loaded are looked up as <lora_dir>/<name> and loaded
    # on first use; past max_loaded_loras the least recently used adapter is unloaded (None: no limit)
    lora_dir: str | None = _lora(
        None,
        "--lora-dir",
        generation_only=True,
        help="A directory of PEFT adapters: a request naming an adapter that is not loaded loads <dir>/<name>.",
    )
    lora_resolver: str | None = _lora(  # None: "dir" when lora_dir is set
        None,
        "--lora-resolver",
        plugin="lora_resolver",
        help="Where an adapter a request names but the server has not loaded comes from: dir (--lora-dir, "
        "the default with it), storage (loras/<name>/ in the storage backend, e.g. the S3 bucket), or a plugin's.",
    )
    max_loaded_loras: int | None = _lora(
        None,
        "--max-loaded-loras",
        check=at_least(1),
        help="Most adapters loaded at once: past it the least recently used one is unloaded (default: no limit).",
    )

    # Files & Batches: a storage plugin's name (None: the one registered as default, local; "none":
    # no /v1/files and /v1/batches, as enable_batches=False).
    batch_storage: str | None = _batch(
        None,
        "--batch-storage",
        envvar="LLMKIT_BATCH_STORAGE",
        plugin="storage",
        extra_choices=("none",),
        plugin_default=True,
        help="Storage backend for /v1/files and /v1/batches: local, s3, or a plugin's; "
        "'none' disables the endpoints. Default: the storage plugin registered as default.",
    )
    enable_batches: bool = True
    file_storage_path: str = _batch(
        "./llmkit_storage",
        "--file-storage-path",
        envvar="LLMKIT_FILE_STORAGE_PATH",
        help="Root directory of the local storage backend.",
    )
    storage_options: tuple[str, ...] = _batch(
        (),
        "--storage-option",
        help="KEY=VALUE for the storage backend (repeatable), e.g. bucket=..., prefix=..., endpoint_url=...",
    )
    batch_max_in_flight: int = _batch(
        4,
        "--batch-max-in-flight",
        check=at_least(1),
        help="Batch lines handed to the engine at once (fewer: faster online responses while a batch runs).",
    )
    batch_lease_ttl: float = _batch(
        30.0,
        "--batch-lease-ttl",
        envvar="LLMKIT_BATCH_LEASE_TTL",
        check=positive,
        help="Seconds a replica's claim on a running batch lasts unrenewed (renewed every third of it): "
        "replicas sharing the storage take over a batch whose runner died once its claim expires.",
    )

    # Serve the model as an embedding model (SGLang's --is-embedding); launch also sets it where
    # the config names an encoder architecture
    is_embedding: bool = _embed(
        False,
        "--is-embedding",
        envvar="LLMKIT_IS_EMBEDDING",
        help="Serve the model at /v1/embeddings (an encoder such as BertModel is recognised from its "
        "config without it; a causal LM embeds its last token, Qwen3-Embedding style); generation "
        "routes then answer 400.",
    )
    is_reranker: bool = _embed(
        False,
        "--is-reranker",
        envvar="LLMKIT_IS_RERANKER",
        help="Serve a causal LM as a yes/no reranker (Qwen3-Reranker style) at /v1/rerank and /v1/score; "
        "cross-encoders (BertForSequenceClassification) are recognised from their config without it.",
    )
    rerank_instruction: str | None = _embed(  # None: the model card's
        None,
        "--rerank-instruction",
        envvar="LLMKIT_RERANK_INSTRUCTION",
        help="The <Instruct> of an --is-reranker model's prompt (default: Qwen3-Reranker's, for web search).",
    )
    pooler_config: str | None = _embed(
        None,
        "--pooler-config",
        envvar="LLMKIT_POOLER_CONFIG",
        help="An embedding model's pooling over what its files say, as vLLM's JSON: "
        '{"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true | false}.',
    )
    max_embedding_inputs: int = _embed(
        2048,
        "--max-embedding-inputs",
        envvar="LLMKIT_MAX_EMBEDDING_INPUTS",
        check=at_least(1),
        help="The most inputs one /v1/embeddings request (documents of a /v1/rerank, pairs of a "
        "/v1/score) may carry (OpenAI's cap: 2048).",
    )
    max_queued_embedding_inputs: int = _embed(
        8192,
        "--max-queued-embedding-inputs",
        envvar="LLMKIT_MAX_QUEUED_EMBEDDING_INPUTS",
        check=at_least(1),
        help="Inputs (documents, pairs) the /v1/embeddings, /v1/rerank and /v1/score requests may hold "
        "at once, waiting or being embedded; beyond this new ones get 429 with Retry-After, and one "
        "request with more is a 400.",
    )

    # Images (vision-language models): where they may come from and how big (multimodal/media.py)
    allowed_media_domains: tuple[str, ...] = _media(
        (),
        "--allowed-media-domains",
        help="A host whose http(s) image URLs are fetched (repeatable; subdomains included). None by "
        "default: images come as data: URLs. Addresses must be public unless the IP or localhost is "
        "listed itself.",
    )
    allowed_local_media_path: str | None = _media(
        None, "--allowed-local-media-path", help="A directory whose files file: image URLs may name (none by default)."
    )
    max_image_bytes: int = _media(
        20 << 20, "--max-image-bytes", check=at_least(1), help="The largest encoded image accepted."
    )
    max_image_pixels: int | None = _media(
        None,
        "--max-image-pixels",
        check=at_least(1),
        help="The most pixels (width x height) an image may decode at; a JPEG decodes at up to 1/8 "
        "scale when the model uses it smaller (default: twice the most the model's processor keeps, "
        "at least 16 Mi, 4096 x 4096).",
    )
    max_images_per_request: int = _media(
        16, "--max-images-per-request", check=non_negative, help="The most images one request may carry."
    )
    media_fetch_timeout: float = _media(
        10.0,
        "--media-fetch-timeout",
        check=positive,
        help="Seconds to fetch one image URL, in all: connecting, redirects and the whole body.",
    )

    # Audio (/v1/audio/transcriptions and /translations): how big an upload, how long its audio (audio/decode.py)
    max_audio_bytes: int = _audio(
        25 << 20,
        "--max-audio-bytes",
        envvar="LLMKIT_MAX_AUDIO_BYTES",
        check=at_least(1),
        help="The largest audio file accepted, in bytes (OpenAI's cap: 25 MB); bigger uploads get 413.",
    )
    max_audio_seconds: float = _audio(
        1800.0,
        "--max-audio-seconds",
        envvar="LLMKIT_MAX_AUDIO_SECONDS",
        check=positive,
        help="The longest audio accepted, in seconds; longer audio gets 400, refused from its header "
        "where it declares its duration, else as soon as decoding passes the limit.",
    )

    # Not options: set at launch, or OpenAI's own caps.
    hf_model_id: str | None = None  # the model's Hugging Face id, accepted too; launch infers it
    model_source: str | None = None  # the weights' file or directory (Ollama's /api/show details); launch sets it
    # Serve a few requests through the routes before listening (launch sets it where the engine
    # warms up: on CUDA unless --skip-server-warmup)
    warm_routes: bool = False
    max_upload_size: int = 200 << 20  # POST /v1/files bodies (batch input files, as OpenAI's cap)
    max_prompt_list: int = 256
    stream_include_usage_default: bool = False
