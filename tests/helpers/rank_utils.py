"""Two real tensor-parallel rank processes running a test's script on gloo over loopback."""

from __future__ import annotations

import subprocess
import sys

from server_utils import free_port


def run_two_ranks(script: str, *args: str, timeout: float = 300) -> list[str]:
    """``python -c script RANK PORT *args`` for ranks 0 and 1; both must exit 0 (their outputs in
    the assertion if not). Returns their outputs."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs
