"""Where stored responses live: the server's storage backend (``--batch-storage``, so ``local``
and ``s3`` keep them across restarts), or, with ``--batch-storage none``, a bounded in-memory map
that lasts as long as the process.

A record is ``{"response": <response object>, "input_items": [...], "context": [...], "owner": ...}``:
``context`` is the conversation before this request's input (what ``previous_response_id``
brought in), so a continuation reads one record, not the whole chain; ``owner`` is the owner id
of the API key that made it, and a record another key made is not found
(``core/server/access/owners.py``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from llmkit.core.server.access.owners import Principal
from llmkit.core.server.errors import APIError

KIND = "response"
MEMORY_LIMIT = 1024  # responses kept without a storage backend (oldest dropped first)


class ResponseStore:
    def __init__(self, storage=None) -> None:
        self.storage = storage
        self.memory: OrderedDict[str, dict] = OrderedDict()

    @property
    def can_store(self) -> bool:
        """Whether records can be kept (a backend written before records existed cannot)."""
        return self.storage is None or getattr(self.storage, "stores_records", True)

    def check_can_store(self) -> None:
        """Refuse ``store: true`` up front rather than after generating the answer."""
        if not self.can_store:
            raise APIError("this server's storage backend cannot store responses; send store: false", param="store")

    async def put(self, record: dict) -> None:
        rid = record["response"]["id"]
        if self.storage is None:
            self.memory[rid] = record
            self.memory.move_to_end(rid)
            while len(self.memory) > MEMORY_LIMIT:
                self.memory.popitem(last=False)
            return
        try:
            await asyncio.to_thread(self.storage.put_record, KIND, rid, record)
        except NotImplementedError:  # a backend that overrides put_record but still cannot
            raise APIError(
                "this server's storage backend cannot store responses; send store: false", param="store"
            ) from None

    async def get(self, rid: str, caller: Principal, param: str | None = None) -> dict:
        """The record, or the same 404 whether it is missing or ``caller`` may not see it."""
        try:
            if self.storage is None:
                record = self.memory[rid]
            else:
                record = await asyncio.to_thread(self.storage.get_record, KIND, rid)
        except (KeyError, NotImplementedError):  # a storage NotFoundError is a KeyError
            record = None
        if record is None or not caller.sees(record.get("owner")):
            raise APIError(f"Response with id '{rid}' not found.", status=404, param=param, code="not_found")
        return record

    async def delete(self, rid: str) -> bool:
        if self.storage is None:
            return self.memory.pop(rid, None) is not None
        try:
            return await asyncio.to_thread(self.storage.delete_record, KIND, rid)
        except (KeyError, NotImplementedError):
            return False
