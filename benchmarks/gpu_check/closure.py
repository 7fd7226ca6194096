"""Fail when a carried wheel needs a package that is neither carried nor on the GPU image (the check's
first run lost its server to fastapi's new opentelemetry-api requirement and openai's httpx2).

    python benchmarks/gpu_check/closure.py WHEEL_DIR IMAGE_PACKAGES_FILE
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker

ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
ENV.update(platform_system="Linux", platform_machine="x86_64", implementation_name="cpython", extra="")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line.split(":", 1)[1].partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(ENV):
            continue
        out.append(norm(re.split(r"[\s\[(<>=!~]", req.strip(), maxsplit=1)[0]))
    return out


def main(wheels: str, image: str) -> int:
    carried = {norm(w.name.split("-")[0]): w for w in Path(wheels).glob("*.whl")}
    have = set(carried) | {norm(x) for x in Path(image).read_text().split() if not x.startswith("#")}
    missing = sorted({(r, w.name) for w in carried.values() for r in requirements(w) if r not in have})
    for r, w in missing:
        print(f"missing: {r} (needed by {w})")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
