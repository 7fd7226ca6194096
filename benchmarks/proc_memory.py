"""Memory of a server's process tree, read from ``/proc`` (the benchmarks that start servers)."""

from __future__ import annotations

import os
import threading


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            for tid in os.listdir(f"/proc/{pids[i]}/task"):  # a child belongs to the thread that forked it
                with open(f"/proc/{pids[i]}/task/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        i += 1
    return pids


def tree_rss(pid: int) -> dict[str, float]:
    """``VmRSS`` / ``RssAnon`` / ``RssFile`` of the process tree of ``pid``, MB."""
    tot = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    k = line.split(":")[0]
                    if k in tot:
                        tot[k] += int(line.split()[1])
        except OSError:
            pass
    return {k: v / 1024 for k, v in tot.items()}


def tree_huge_mb(pid: int) -> float:
    """Anonymous memory of the process tree in transparent huge pages (``AnonHugePages``), MB: the
    weights llmkit advises into 2 MB pages (core/model/cpu/hugepages.py) where the kernel found them."""
    kb = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                kb += sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        except OSError:
            pass
    return kb / 1024


class PeakRSS:
    """Samples the process tree's resident memory every ``interval`` s in a thread; ``peak`` is the
    largest ``VmRSS`` seen (with the anonymous part at that moment)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = pid, interval
        self.peak = {"VmRSS": 0.0, "RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = tree_rss(self.pid)
            if now["VmRSS"] > self.peak["VmRSS"]:
                self.peak = now
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return self.peak
