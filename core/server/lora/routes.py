"""``POST /load_lora_adapter`` and ``/unload_lora_adapter`` (vLLM's and SGLang's routes and bodies:
``{"lora_name", "lora_path"}`` and ``{"lora_name"}``), behind the API key like every route but
/health; with a keys file, admin keys only (an adapter changes what every caller may select).

The engine loads between steps; a refused adapter (bad path, rank, shape, corrupt file) is a 400
with nothing loaded, and the server serves on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from llmkit.core.lora.resolver import plain_name
from llmkit.core.server.access.owners import principal
from llmkit.core.server.body import read_json
from llmkit.core.server.errors import APIError
from llmkit.core.server.model_names import is_served, shown

LOAD_TIMEOUT_S = 120.0
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path names no file


def _name(body: dict, field: str = "lora_name") -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise APIError(f"'{field}' is required (a non-empty string)", param=field)
    return value.strip()


def _new_name(body: dict) -> str:
    """A name to load an adapter as: one plain path segment, as a --lora-dir lookup takes (the
    name is a model name in every request, a metric label and a log line)."""
    name = _name(body)
    if not plain_name(name):
        raise APIError(
            f"'lora_name' `{shown(name)}` is not a plain name: at most 255 characters, without '/', '\\' "
            "or NUL, not starting with '.'",
            param="lora_name",
        )
    return name


def _path(body: dict) -> str:
    path = _name(body, "lora_path")
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise APIError(
            f"'lora_path' must be a path of at most {MAX_PATH_CHARS} characters, without NUL", param="lora_path"
        )
    return path


def lora_router(state) -> APIRouter:
    router = APIRouter()

    def check_admin(raw: HTTPRequest) -> None:
        if not principal(raw).admin:
            raise APIError("loading and unloading LoRA adapters needs an admin key", status=403)

    @router.post("/load_lora_adapter")
    async def load(raw: HTTPRequest):
        check_admin(raw)
        body = await read_json(raw)
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object with lora_name and lora_path")
        name, path = _new_name(body), _path(body)
        if is_served(state.options, name):
            raise APIError(f"'{name}' is the served model's name; give the adapter another", param="lora_name")
        if name in state.loras:
            raise APIError(f"a LoRA adapter named '{name}' is already loaded", param="lora_name")
        try:
            await asyncio.wait_for(state.client.load_lora_adapter(name, path), LOAD_TIMEOUT_S)
        except ValueError as exc:
            raise APIError(str(exc), param="lora_path") from None
        except NotImplementedError as exc:
            raise APIError(str(exc), status=501) from None
        state.loras[name] = path
        return JSONResponse({"status": "ok", "message": f"LoRA adapter '{name}' loaded", "lora_name": name})

    @router.post("/unload_lora_adapter")
    async def unload(raw: HTTPRequest):
        check_admin(raw)
        body = await read_json(raw)
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object with lora_name")
        name = _name(body)
        if name not in state.loras:
            raise APIError(
                f"The LoRA adapter `{shown(name)}` is not loaded", status=404, param="lora_name", code="model_not_found"
            )
        path = state.loras.pop(name)  # new requests naming it are refused from now on
        try:
            await asyncio.wait_for(state.client.unload_lora_adapter(name), LOAD_TIMEOUT_S)
        except KeyError:
            pass  # the engine had dropped it already
        except NotImplementedError as exc:
            state.loras[name] = path
            raise APIError(str(exc), status=501) from None
        if name in state.resolved_loras:  # the resolver's copy of it may go
            state.resolved_loras.discard(name)
            state.lora_resolver.release(name, Path(path))
        return JSONResponse({"status": "ok", "message": f"LoRA adapter '{name}' unloaded", "lora_name": name})

    return router
