"""Chat templates render on their own threads, not on the shared default executor.

A template that runs into its render deadline (server/chat_template.py) holds a thread for those
seconds. On asyncio's default executor (a handful of threads on a small machine) a few such renders
would queue every other ``to_thread`` call (tokenizing, storage, parsers) behind them; here only
renders share threads, and there are enough that one slow request delays only itself.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

RENDER_THREADS = 16


def render_pool() -> ThreadPoolExecutor:
    """A new pool for a server (its threads start on demand)."""
    return ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="llmkit-render")


async def run_render(state, fn, *args):
    """Run a rendering function (``render_chat``) on the server's render threads."""
    return await asyncio.get_running_loop().run_in_executor(state.render_pool, functools.partial(fn, *args))
