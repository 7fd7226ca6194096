"""Which ``model`` names the server answers to: the served name and its aliases.

A request naming another model gets 404 ``model_not_found``, as OpenAI and vLLM answer, instead of
a 200 that echoes a name the server never served. A request that leaves ``model`` out is served
by the one model there is.
"""

from __future__ import annotations

from llmkit.core.server.errors import APIError


def served_names(options) -> tuple[str, ...]:
    """The primary name (shown in /v1/models) first, then the aliases."""
    return (options.served_model_name, *options.served_model_aliases)


def model_not_found(name: str) -> APIError:
    return APIError(f"The model '{name}' does not exist", status=404, param="model", code="model_not_found")


def check_model(options, body) -> None:
    """Raise 404 unless ``body.model`` (when the request set it) is a served name."""
    if "model" not in body.model_fields_set:
        return
    if body.model not in served_names(options):
        raise model_not_found(body.model)
