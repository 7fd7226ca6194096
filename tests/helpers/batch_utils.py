"""Helpers for the Files & Batches tests: a fake executor (no engine), batch files, a small app."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from llmkit.core.batches.batches_routes import batches_router
from llmkit.core.batches.files_routes import files_router
from llmkit.core.batches.runner import BatchRunner
from llmkit.core.batches.storage import FileRecord, new_file_id


async def fake_execute(endpoint: str, body: dict) -> tuple[int, dict]:
    """Echoes the last message; ``"fail"`` in it gives a 400, ``"boom"`` raises."""
    await asyncio.sleep(0)
    text = body["messages"][-1]["content"]
    if "fail" in text:
        return 400, {"error": {"message": "bad line", "type": "invalid_request_error", "code": "bad"}}
    if "boom" in text:
        raise RuntimeError("engine exploded")
    return 200, {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": body.get("model"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def jsonl(n: int, contents=None, url: str = "/v1/chat/completions") -> bytes:
    lines = []
    for i in range(n):
        content = contents(i) if contents else f"hello {i}"
        lines.append(
            json.dumps(
                {
                    "custom_id": f"r-{i}",
                    "method": "POST",
                    "url": url,
                    "body": {"model": "m", "messages": [{"role": "user", "content": content}]},
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


def upload(storage, data: bytes) -> str:
    fid = new_file_id()
    storage.write_blob(fid, [data])
    storage.put_file(FileRecord(fid, len(data), int(time.time()), "in.jsonl", "batch"))
    return fid


def read_file(storage, file_id):
    if file_id is None:
        return []
    return [json.loads(x) for x in b"".join(storage.read_blob(file_id)).splitlines()]


async def run_batch(storage, execute, n: int = 5, data: bytes | None = None, **kw):
    runner = BatchRunner(storage, execute, **kw)
    await runner.start()
    fid = upload(storage, data if data is not None else jsonl(n))
    rec = await runner.create(fid, "/v1/chat/completions", "24h")
    rec = await runner.wait(rec.id)
    await runner.stop()
    return rec, read_file(storage, rec.output_file_id), read_file(storage, rec.error_file_id)


def make_app(storage, execute, **runner_kw) -> FastAPI:
    """Mounts the routers and runner the way ``create_app`` does."""
    runner = BatchRunner(storage, execute, **runner_kw)

    @asynccontextmanager
    async def lifespan(app):
        await runner.start()
        yield
        await runner.stop()

    app = FastAPI(lifespan=lifespan)
    app.include_router(files_router(storage, max_upload_bytes=1 << 20))
    app.include_router(batches_router(runner))
    return app
