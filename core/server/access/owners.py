"""Who owns a stored file, batch or response, and who may see it.

OpenAI scopes these objects to a project; here a key is the project. Each object records its
maker's owner id (:class:`~llmkit.core.server.access.keys.APIKey`'s ``owner``, never the key), and
only that key or an admin sees it: any other caller gets the 404 of an id that does not exist, so
ids do not leak. Objects with no owner (made before keys had owners, or by a server without keys)
are seen by admins only. A server without keys has one anonymous caller, who sees everything.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

SCOPE_KEY = "llmkit.principal"  # where the access middleware leaves the caller in the ASGI scope


@dataclass(frozen=True)
class Principal:
    owner: str | None  # stored as the owner of what this caller makes
    admin: bool = False

    def sees(self, owner: str | None) -> bool:
        return self.admin or (owner is not None and owner == self.owner)


# The prefix-cache salt of the caller's key (``APIKey.cache_scope``), set by the access middleware
# for the request's handlers; None: the shared space (no keys, or a key with cache=shared).
current_cache_scope: ContextVar[str | None] = ContextVar("llmkit_cache_scope", default=None)


def cache_salt(scope: str | None, requested: str | None) -> str | None:
    """A request's prefix-cache salt: its key's scope and the ``cache_salt`` it sent (vLLM's
    field, for a client that wants a namespace of its own within its key's)."""
    if requested is None:
        return scope
    return f"{scope or ''}\0{requested}"


# A server without keys: everything made is ownerless and everyone sees everything, as before.
ANONYMOUS = Principal(owner=None, admin=True)


def principal(request) -> Principal:
    """The caller of ``request`` (a Starlette request), as the access middleware found it."""
    return request.scope.get(SCOPE_KEY, ANONYMOUS)
