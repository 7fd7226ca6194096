"""Outputs cross from the engine thread to the event loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from llmkit.core.engine.client import LoopMailbox


def test_a_burst_arrives_whole_and_in_order_with_few_wakeups():
    async def main():
        loop = asyncio.get_running_loop()
        box = LoopMailbox(loop)
        wakeups = [0]
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakeups[0] += 1
            return real(cb, *args)

        loop.call_soon_threadsafe = counting
        queues = [asyncio.Queue() for _ in range(100)]
        go = threading.Event()

        def engine_thread():  # 50 steps, each emitting one output per stream
            go.wait()
            for step in range(50):
                for i, q in enumerate(queues):
                    box.put(q, (i, step))

        t = threading.Thread(target=engine_thread)
        t.start()
        go.set()
        got = [[await asyncio.wait_for(q.get(), 10) for _ in range(50)] for q in queues]
        t.join()
        assert got == [[(i, s) for s in range(50)] for i in range(100)]
        assert wakeups[0] < 5000  # fewer than one per output (the loop drained them in bursts)

    asyncio.run(main())


def test_a_closed_loop_drops_outputs_quietly():
    loop = asyncio.new_event_loop()
    box = LoopMailbox(loop)
    loop.close()
    box.put(asyncio.Queue(), "late")  # the server is gone: nobody waits for it, nothing raises
