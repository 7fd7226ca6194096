"""``llmkit serve``'s options for where it listens, who may call it, and the limits that keep one client from starving the rest."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, negated, panel


def _api_keys(keys, _) -> dict:
    return {"server.api_keys": tuple(keys or ())}


SERVER_OPTIONS = panel(
    "HTTP server and limits",
    ServeOption(("--host",), str, "127.0.0.1", to="server", envvar="LLMKIT_HOST"),
    ServeOption(("--port",), int, 30000, to="server", envvar="LLMKIT_PORT"),
    ServeOption(("--log-level",), str, "info", to="server"),
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
    ServeOption(("--max-payload-size",), int, 32 << 20, to="server", help="Request body cap in bytes."),
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
        ("--shutdown-timeout",),
        int,
        30,
        to="server",
        help="Seconds to drain in-flight requests after SIGTERM (those left then get 503; "
        "a second SIGTERM exits at once).",
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
)
