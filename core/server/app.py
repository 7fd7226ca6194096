"""``create_app``: the FastAPI application over an engine client."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from llmkit.core.engine.client import QueueFullError
from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.server.access.keys import KeyRing, load_keys
from llmkit.core.server.access.middleware import AccessMiddleware
from llmkit.core.server.access.owners import principal
from llmkit.core.server.body import parse_model, read_json
from llmkit.core.server.errors import APIError, error_response
from llmkit.core.server.limits import BodyLimitMiddleware, install_error_handlers
from llmkit.core.server.model_names import is_served, listed_adapters, model_not_found
from llmkit.core.server.openai.chat import create_chat_completion
from llmkit.core.server.openai.completions import create_completion
from llmkit.core.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmkit.core.server.sglang.parsers import parser_router
from llmkit.core.server.shutdown import DrainMiddleware
from llmkit.core.server.state import ServerState, new_id

log = logging.getLogger("llmkit")
# Open without the key, by exact path: a later /health_generate-like route is not open by accident.
OPEN_PATHS = frozenset({"/health"})  # a load balancer probes it without the key


def _join_gateway(state: ServerState):
    from llmkit.core.server.sglang.register import GatewayRegistration, advertised_url, local_url

    opts = state.options
    registration = GatewayRegistration(
        opts.gateway_url,
        advertised_url(opts.host, opts.port, opts.gateway_worker_url),
        local_url(opts.host, opts.port),
        next((k for k in opts.api_keys if k), None),
        draining=lambda: state.client.draining,
    )
    registration.start()
    return registration


def create_app(state: ServerState, *, on_shutdown=None, services=(), routers=(), storage=None) -> FastAPI:
    """Build the app. ``services`` (objects with async ``start``/``stop``, e.g. the batch runner)
    run for the app's lifetime; ``routers`` are mounted beside the OpenAI routes; ``storage`` (a
    storage backend, or None) keeps stored Responses; ``on_shutdown`` runs after in-flight
    requests have drained."""

    def shutdown():
        if on_shutdown is not None:
            on_shutdown()

    @asynccontextmanager
    async def lifespan(app):
        for service in services:
            await service.start()  # the batch runner resumes batches a previous process left
        if opts.warm_routes:  # (a keys file's keys are not known in plain: only --api-key's)
            from llmkit.core.server.warmup import warm_routes

            await warm_routes(app, opts.served_model_name, next((k for k in opts.api_keys if k), None))
        joined = _join_gateway(state) if opts.gateway_url else None  # registers once /health answers
        yield
        if joined is not None:  # (already left if draining began: this covers the rest)
            await asyncio.to_thread(joined.stop)
        for service in services:
            await service.stop()
        state.client.draining = True
        await asyncio.to_thread(shutdown)

    app = FastAPI(title="llmkit", lifespan=lifespan)
    app.state.llmkit = state
    app.state.shutdown = shutdown
    opts = state.options
    keys = load_keys(opts.api_keys, opts.api_keys_file)
    if keys:
        log.info("%d API keys (%d admin)", len(keys), sum(k.admin for k in keys))

    # The key check wraps the body cap (added last = outermost): no body is read without the key.
    app.add_middleware(
        BodyLimitMiddleware,
        limit=state.options.max_payload_size,
        upload_limit=state.options.max_upload_size + (64 << 10),
    )  # + multipart headers
    app.add_middleware(DrainMiddleware, state=state)  # 503 for new requests once SIGTERM came
    if state.embedder is not None:  # inside the key check: a caller without the key learns nothing
        from llmkit.core.server.model_kind import EmbeddingOnlyMiddleware

        scores = state.embedder.kind == "score"
        app.add_middleware(EmbeddingOnlyMiddleware, served_name=opts.served_model_name, scores=scores)
    if state.speech is not None:
        from llmkit.core.server.model_kind import SpeechOnlyMiddleware

        app.add_middleware(SpeechOnlyMiddleware, served_name=opts.served_model_name)
    if keys or opts.rate_limit_rpm or opts.rate_limit_tpm:
        from llmkit.core.server.web_ui import WEB_OPEN_EXACT, WEB_OPEN_PATHS

        # The playground's page and static files are public (the page asks for the key); /metrics
        # only on request.
        open_exact = OPEN_PATHS | ({"/metrics"} if opts.metrics_no_auth else set())
        open_exact |= WEB_OPEN_EXACT if opts.enable_web_ui else set()
        app.add_middleware(
            AccessMiddleware,
            keys=KeyRing(keys) if keys else None,
            rpm=opts.rate_limit_rpm,
            tpm=opts.rate_limit_tpm,
            open_exact=frozenset(open_exact),
            open_prefixes=WEB_OPEN_PATHS if opts.enable_web_ui else (),
        )
    install_error_handlers(app)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(QueueFullError)
    async def _queue_full(request, exc):
        return error_response(str(exc), 429, code="rate_limit_exceeded")

    @app.post("/v1/chat/completions")
    async def chat(raw: HTTPRequest):
        body = parse_model(ChatCompletionRequest, await read_json(raw))
        return await create_chat_completion(state, body, raw)

    @app.post("/v1/completions")
    async def completions(raw: HTTPRequest):
        body = parse_model(CompletionRequest, await read_json(raw))
        return await create_completion(state, body, raw)

    def model_card() -> dict:
        name = state.options.served_model_name
        return {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "llmkit",
            "root": name,
            "parent": None,
            "max_model_len": state.max_context,
        }

    def adapter_card(name: str) -> dict:
        # as vLLM lists an adapter: its own id and root (the path), the base model as parent
        base = model_card()
        return {**base, "id": name, "root": state.loras[name], "parent": base["id"]}

    @app.get("/v1/models")
    async def models(raw: HTTPRequest):
        listed = listed_adapters(state, principal(raw))
        return {"object": "list", "data": [model_card(), *(adapter_card(n) for n in listed)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id in state.loras and not is_served(state.options, model_id):
            return adapter_card(model_id)
        if not is_served(state.options, model_id):
            return model_not_found(state.options, model_id).response()
        return {**model_card(), "id": model_id}

    @app.get("/health")
    async def health():
        if state.client.draining:
            return error_response("the server is shutting down", 503)
        if not state.client.alive():
            return error_response("the engine is not running", 503)
        age, limit = state.client.progress_age(), state.options.health_stall_timeout
        if age > limit:
            return error_response(
                f"the engine made no progress for {age:.0f} s (--health-stall-timeout {limit:g})", 503
            )
        degraded = state.client.degraded()
        if degraded:  # still serving (on the replicas that are up): 200, so it stays in rotation
            return JSONResponse({"status": "degraded", "detail": degraded})
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate():
        if state.client.draining or not state.client.alive():
            return error_response("the engine is not running", 503)
        req = GenerateRequest(
            rid=new_id("health-"), prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0)
        )
        try:
            async with asyncio.timeout(20):
                async for _ in state.client.generate(req):
                    pass
        except TimeoutError:
            return error_response("the engine did not answer within 20 s", 503)
        return JSONResponse({"status": "ok"})

    # SGLang's Model Gateway asks for /model_info and /server_info first (the get_ names are
    # SGLang's older ones, which it falls back to) when it registers a worker.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": state.options.served_model_name,
            "tokenizer_path": state.options.served_model_name,
            "is_generation": state.embedder is None and state.speech is None,
            "max_model_len": state.max_context,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        from llmkit.core.server.generation.sampling_defaults import effective_defaults

        return {
            "served_model_name": state.options.served_model_name,
            "max_model_len": state.max_context,
            # what a request that leaves its sampling fields out samples with (--generation-config)
            "sampling_defaults": effective_defaults(state.sampling_defaults),
            **state.client.stats(),
        }

    from llmkit.core.server.anthropic.routes import anthropic_router
    from llmkit.core.server.openai.audio import audio_router
    from llmkit.core.server.openai.embeddings import embeddings_router
    from llmkit.core.server.openai.scores import scores_router
    from llmkit.core.server.responses.routes import responses_router
    from llmkit.core.server.sglang.generate import generate_router
    from llmkit.core.server.sglang.load import load_router
    from llmkit.core.server.sglang.tokenize import tokenize_router

    app.include_router(audio_router(state))
    app.include_router(tokenize_router(state))
    app.include_router(embeddings_router(state))
    app.include_router(scores_router(state))
    app.include_router(generate_router(state))
    app.include_router(load_router(state))
    app.include_router(anthropic_router(state))
    from llmkit.core.server.ollama.routes import ollama_router

    app.include_router(ollama_router(state))
    app.include_router(responses_router(state, storage))
    app.include_router(parser_router())
    from llmkit.core.server.lora.routes import lora_router

    app.include_router(lora_router(state))
    if state.options.enable_metrics:
        from llmkit.core.server.metrics import ServerMetrics, metrics_router

        if state.metrics is None:
            state.metrics = ServerMetrics(state.options.served_model_name, [state.client.stats])
        app.include_router(metrics_router(state.metrics))
    if state.options.enable_web_ui:
        from llmkit.core.server.web_ui import web_router

        app.include_router(web_router(state))
    for router in routers:
        app.include_router(router)
    return app
