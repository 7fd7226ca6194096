"""Which ``model`` names the server answers to: the served name, its aliases and the model's
Hugging Face id.

A request naming another model gets 404 ``model_not_found``, as OpenAI and vLLM answer, instead of
a 200 that echoes a name the server never served; the error lists the names that are served. A
request that leaves ``model`` out is served by the one model there is. A loaded LoRA adapter's name
is a model name too (vLLM's way), or SGLang's ``lora_path`` names it: the request generates with it.
"""

from __future__ import annotations

from llmkit.core.server.access.owners import principal
from llmkit.core.server.errors import APIError

SHOWN_NAME_CHARS = 128  # of a requested name an error quotes (a client may send 10 KB of one)


def shown(name) -> str:
    """A requested name as an error quotes it: cut where it is long."""
    name = str(name)
    return name if len(name) <= SHOWN_NAME_CHARS else name[:SHOWN_NAME_CHARS] + "..."


def listed_adapters(state, caller) -> list[str]:
    """The loaded adapters listed to ``caller`` (a Principal; None: no HTTP caller, a batch line)
    in /v1/models and in 404s: every one to an admin; to anyone else the ones the operator gave
    (at start, or through /load_lora_adapter), not those the resolver loaded because some caller
    named them (one tenant's adapter names are not another's to learn; naming one still works)."""
    if caller is not None and caller.admin:
        return list(state.loras)
    return [n for n in state.loras if n not in state.resolved_loras]


def served_names(options) -> tuple[str, ...]:
    """The primary name (shown in /v1/models) first, then the aliases, then the Hugging Face id."""
    hf_id = (options.hf_model_id,) if options.hf_model_id else ()
    return tuple(dict.fromkeys((options.served_model_name, *options.served_model_aliases, *hf_id)))


def is_served(options, name: str) -> bool:
    # The hub resolves ids in any letter case (SGLang's notebooks send qwen/qwen2.5-0.5b-instruct
    # for Qwen/Qwen2.5-0.5B-Instruct), so the id matches in any case here too; other names exactly.
    hf_id = options.hf_model_id
    return name in served_names(options) or (hf_id is not None and name.lower() == hf_id.lower())


def model_not_found(options, name: str, adapters=()) -> APIError:
    served = ", ".join(f"`{n}`" for n in served_names(options))
    loras = f"; LoRA adapters: {', '.join(f'`{n}`' for n in adapters)}" if adapters else ""
    return APIError(
        f"The model `{shown(name)}` does not exist. Served: {served}{loras} (add names with --served-model-name)",
        status=404,
        param="model",
        code="model_not_found",
    )


def check_model(options, body) -> None:
    """Raise 404 unless ``body.model`` (when the request set it) is a served name."""
    if "model" not in body.model_fields_set or body.model is None:  # null: as if left out
        return
    if not is_served(options, body.model):
        raise model_not_found(options, body.model)


def _lora_path(body):
    """SGLang's ``lora_path`` extra field; a per-prompt list naming one adapter is that adapter."""
    lora = (body.model_extra or {}).get("lora_path") if body.model_extra is not None else None
    if isinstance(lora, list) and len(set(lora)) == 1:
        lora = lora[0]
    return lora


def adapter_of(state, body, caller=None) -> str | None:
    """The LoRA adapter ``body`` asks for (by ``model``, or SGLang's ``lora_path``), None for the
    base model; 404 ``model_not_found`` for a name that is neither served nor a loaded adapter,
    listing the adapters ``caller`` is shown (:func:`listed_adapters`)."""
    lora = _lora_path(body)
    if lora is not None:
        if not isinstance(lora, str) or lora not in state.loras:
            loaded = ", ".join(f"`{n}`" for n in listed_adapters(state, caller)) or "none"
            raise APIError(
                f"The LoRA adapter `{shown(lora)}` is not loaded (loaded: {loaded})",
                status=404,
                param="lora_path",
                code="model_not_found",
            )
        return lora
    if "model" not in body.model_fields_set or body.model is None or is_served(state.options, body.model):
        return None
    if body.model in state.loras:
        return body.model
    raise model_not_found(state.options, body.model, listed_adapters(state, caller))


def _requested(body) -> str | None:
    lora = _lora_path(body)
    if isinstance(lora, str):
        return lora
    return body.model if "model" in body.model_fields_set and body.model is not None else None


async def resolve_adapter(state, body, raw=None) -> str | None:
    """:func:`adapter_of` for the caller of ``raw`` (the HTTP request; None for a batch line),
    after loading a named adapter through the resolver on first use (and unloading the least
    recently used past ``--max-loaded-loras``)."""
    caller = principal(raw) if raw is not None else None
    try:
        name = adapter_of(state, body, caller)
    except APIError as exc:
        name = _requested(body)
        if state.lora_resolver is None or exc.status != 404 or name is None:
            raise
        from llmkit.core.server.lora.resolver import load_resolved

        if not await load_resolved(state, name):
            raise
        name = adapter_of(state, body, caller)
    if name is not None and name in state.loras:
        state.loras[name] = state.loras.pop(name)  # most recently used last (the LRU order)
    return name
