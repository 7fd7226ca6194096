"""API keys: ``--api-key`` (repeatable) and ``--api-keys-file``.

The keys file has one key a line, then optional fields separated by spaces::

    # KEY         [NAME]   [admin]  [rpm=N]  [tpm=N]  [cache=SPACE]
    sk-4f9c...    alice
    sk-81be...    ops      admin
    sk-0d2a...    batchbot rpm=600 tpm=200000
    sk-77c1...    agent-a  cache=agents
    sk-9e03...    agent-b  cache=agents

Blank lines and lines starting with ``#`` are skipped, as is everything after a `` #``. NAME
(letters, digits, ``_.@-``, at most 64) is the key's owner id, stored with the files, batches and
responses it makes; a key without a name is owned by ``key-`` and 16 hex digits of a hash of the
key. ``rpm=``/``tpm=`` override ``--rate-limit-rpm``/``--rate-limit-tpm`` for that key (0: none).

A key's prompts are cached for that key's owner alone: a prefix one owner computed is never reused
for another (its timing would tell the other that someone sent it). ``cache=SPACE`` (same
characters as a name) puts the key's prefixes in a space the operator shares: keys naming the
same space reuse each other's prefixes; ``cache=shared`` is the space of a server without keys.

Only digests of the keys are kept, and no message here ever quotes a key (nor any field of a
line, since a mistyped line may hold a key where a name was expected).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
LIMIT_RE = re.compile(r"(rpm|tpm)=([0-9]{1,12})")
CACHE_RE = re.compile(r"cache=([A-Za-z0-9_.@-]{1,64})")
SHARED_CACHE = "shared"  # cache=shared: the prefix cache's space of a server without keys
COMMENT_RE = re.compile(r"\s#")


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the line, never its contents."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def hashed_owner(key: str) -> str:
    # Domain-separated from the digest compared at login, so the stored id is no shortcut to it.
    return "key-" + hashlib.sha256(b"llmkit-owner\0" + key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True)
class APIKey:
    owner: str  # stable and not secret: stored with the objects the key makes
    digest: bytes = b""  # sha256 of the key; the key itself is not kept
    admin: bool = False  # sees and manages every key's objects
    rpm: int | None = None  # requests per minute; None: --rate-limit-rpm
    tpm: int | None = None  # tokens per minute; None: --rate-limit-tpm
    cache: str | None = None  # the prefix cache's space (cache=SPACE); None: its owner's own

    @property
    def cache_scope(self) -> str | None:
        """The salt of this key's prefixes (None: the space shared by everyone without one)."""
        if self.cache == SHARED_CACHE:
            return None
        return "space:" + self.cache if self.cache is not None else "owner:" + self.owner

    def __repr__(self) -> str:  # no digest in logs or tracebacks either
        return f"APIKey(owner={self.owner!r}, admin={self.admin})"


def parse_keys_file(text: str, source: str = "the keys file") -> list[tuple[int, APIKey]]:
    """``(line number, APIKey)`` for each key line of ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = COMMENT_RE.split(line, 1)[0].split()
        if not fields or fields[0].startswith("#"):
            continue
        key, name, admin, limits, cache = fields[0], None, False, {}, None
        for position, field in enumerate(fields[1:], 2):
            where = f"{source} line {number}, field {position}"
            if field == "admin":
                admin = True
            elif m := LIMIT_RE.fullmatch(field):
                limits[m.group(1)] = int(m.group(2))
            elif m := CACHE_RE.fullmatch(field):
                cache = m.group(1)
            elif name is None and NAME_RE.fullmatch(field):
                name = field
            elif name is None:
                raise KeysFileError(f"{where}: a name is letters, digits and _.@- (at most 64)")
            else:
                raise KeysFileError(f"{where}: expected admin, rpm=N, tpm=N or cache=SPACE after the name")
        owner = name or hashed_owner(key)
        found.append((number, APIKey(owner, digest(key), admin, limits.get("rpm"), limits.get("tpm"), cache)))
    return found


def load_keys(api_keys: Iterable[str] = (), keys_file: str | None = None) -> list[APIKey]:
    """Every key the server accepts (none: the server is open, as without ``--api-key``).

    A lone ``--api-key`` with no keys file is the admin: before keys owned objects it saw all of
    them, and so it still does. Keys given with ``--api-key`` beside others are plain keys."""
    given = [(f"--api-key #{i}", APIKey(hashed_owner(key), digest(key))) for i, key in enumerate(api_keys, 1) if key]
    if keys_file is not None:
        path = Path(keys_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"--api-keys-file '{keys_file}' cannot be read: {type(exc).__name__}") from None
        source = f"--api-keys-file '{keys_file}'"
        lines = parse_keys_file(text, source)
        if not lines:
            raise KeysFileError(f"{source} holds no key")
        given += [(f"{source} line {n}", k) for n, k in lines]
    elif len(given) == 1:
        given = [(where, replace(k, admin=True)) for where, k in given]
    keys, by_digest, by_owner = [], {}, {}
    for where, k in given:
        if k.digest in by_digest:
            raise KeysFileError(f"{where}: the same key as {by_digest[k.digest]}")
        if k.owner in by_owner:
            raise KeysFileError(f"{where}: the same name as {by_owner[k.owner]}")
        by_digest[k.digest], by_owner[k.owner] = where, where
        keys.append(k)
    return keys


class KeyRing:
    """The accepted keys, matched in constant time."""

    def __init__(self, keys: list[APIKey]) -> None:
        self.keys = keys

    def match(self, given: str) -> APIKey | None:
        """The key ``given`` is, or None. Its digest is compared with every key's, with no early
        exit, so the time taken says nothing about which key (if any) matched."""
        d = digest(given)
        found = None
        for k in self.keys:
            if hmac.compare_digest(d, k.digest):
                found = k
        return found
