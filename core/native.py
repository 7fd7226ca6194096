"""Our own C kernels (AVX2 + OpenMP), compiled on first use and loaded with ctypes.

Plain C against no torch headers compiles in about a second, where a torch C++ extension takes a
minute; the kernels take raw pointers from ``Tensor.data_ptr()``. The shared object is cached under
``$LLMKIT_CACHE_DIR`` (default ``~/.cache/llmkit``) by a hash of the source, the flags and the
compiler, so a server start after the first pays nothing. Its OpenMP runtime is the one torch has
already loaded (same soname), so the kernels share torch's thread pool and thread count instead of
starting a second pool that would fight it for the cores.

Every caller keeps a pure-torch path: :func:`load` returns None where there is no C compiler, no
AVX2/FMA, a build fails, the tensors are not on the CPU, or ``LLMKIT_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -ffp-contract=off: no FMA the source did not ask for, so every build keeps the same arithmetic
FLAGS = [
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-fno-math-errno",
    "-ffp-contract=off",
]


# Extra flags and the /proc/cpuinfo flags they need, by instruction set: a kernel written for
# AVX-512 builds (and runs) only where the CPU has it; callers keep their other path elsewhere.
ISAS = {
    "avx2": ([], ("avx2", "fma", "f16c")),
    # plain loops the compiler vectorises 16 floats wide
    "avx512": (
        ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mprefer-vector-width=512"],
        ("avx512f", "avx512vl", "avx512bw"),
    ),
    "avx512vnni": (
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    ),
}


_HEADERS = Path(__file__).parent


def enabled() -> bool:
    return os.environ.get("LLMKIT_NATIVE", "1") not in ("0", "false", "no", "")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    if sys.platform != "linux":
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def cpu_has(isa: str) -> bool:
    """Whether this CPU runs kernels built for ``isa`` (a key of :data:`ISAS`)."""
    return all(f in _cpu_flags() for f in ISAS["avx2"][1] + ISAS[isa][1])


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    return Path(os.environ.get("LLMKIT_CACHE_DIR") or Path.home() / ".cache" / "llmkit") / "native"


@functools.cache
def _build(source: str, isa: str = "avx2") -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not cpu_has(isa):
        return None
    # the shared header (simd_math.h) is on the include path and part of the build key
    flags = FLAGS + ISAS[isa][0] + ["-I", str(_HEADERS)]
    src = Path(source)
    text = src.read_bytes() + (_HEADERS / "simd_math.h").read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(text + " ".join(flags).encode() + version).hexdigest()[:16]
    out = _cache_dir() / f"{src.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target, then rename: concurrent first starts never load a half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            os.unlink(tmp)
            log.warning("building %s failed; using the torch path:\n%s", src.name, proc.stderr[-2000:])
            return None
        os.replace(tmp, out)
    import torch  # noqa: F401  (its libgomp is loaded first, so the kernels bind to it)

    return ctypes.CDLL(str(out))


def load(source: str | os.PathLike, isa: str = "avx2", **signatures: list) -> ctypes.CDLL | None:
    """The compiled library of C file ``source``, or None where native kernels are not to be used
    (``isa``: the instruction set it is written for, a key of :data:`ISAS`).
    ``signatures``: each function's ctypes argument types (the functions return nothing)."""
    if not enabled():
        return None
    lib = _build(str(source), isa)
    if lib is not None:
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, argtypes
    return lib


def ptr(t) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
