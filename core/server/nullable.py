"""JSON ``null`` for an optional field means "not sent", as in OpenAI's schema (nearly every
optional field there is nullable, and SGLang's Model Gateway forwards ``"stream": null``)."""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator


def _admits_none(tp) -> bool:
    if tp is None or tp is type(None) or tp is Any:
        return True
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_admits_none(a) for a in get_args(tp))
    if origin is Annotated:
        return _admits_none(get_args(tp)[0])
    if origin is Literal:
        return None in get_args(tp)
    return False


@functools.cache
def _defaulted_non_nullable(cls: type[BaseModel]) -> frozenset[str]:
    """Names of the fields that have a default but whose type does not take None."""
    names = set()
    for name, field in cls.model_fields.items():
        if not field.is_required() and not _admits_none(field.annotation):
            names.add(field.alias or name)
    return frozenset(names)


class NullMeansDefault(BaseModel):
    """Drops a ``null`` given for a field with a default that is not itself nullable, so the
    default applies. Nullable fields keep their null (a completion's ``max_tokens: null`` means
    no cap, not 16), and a required field given null is still refused."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            drop = _defaulted_non_nullable(cls)
            if any(data.get(k, 0) is None for k in drop):
                data = {k: v for k, v in data.items() if not (v is None and k in drop)}
        return data


class RequestModel(NullMeansDefault):
    """A request body of the OpenAI-style APIs: strict types (``"10"`` is not an int), unknown
    fields ignored (kept in ``model_extra``), null meaning "not sent"."""

    model_config = ConfigDict(extra="allow", strict=True)
