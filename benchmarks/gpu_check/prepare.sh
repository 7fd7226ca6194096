#!/usr/bin/env bash
# CPU side of the GPU check: download the cp312 wheels the GPU image lacks into .whl/ (git-ignored)
# at the versions installed here, so the check runs the same server stack. Run from the repo root:
#   bash benchmarks/gpu_check/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# what the GPU image (torch, triton, transformers, httpx, typer, msgpack, ...) does not have
pkgs="fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection xgrammar apache-tvm-ffi
gguf pyzmq openai jiter distro sniffio jsonschema jsonschema-specifications referencing rpds-py python-multipart
httpx2 httpcore2 truststore opentelemetry-api typing-extensions anyio h11 idna certifi annotated-doc orjson pillow
anthropic docstring-parser py-spy"
specs=""
for p in $pkgs; do
    v=$("${PYTHON:-python3}" -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null || true)
    specs="$specs $p${v:+==$v}"
done
plat=""
for n in 17 24 27 28 31 34 35; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
for s in $specs; do
    ls .whl | grep -qi "^$(echo "${s%%==*}" | tr - _)-" && continue
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $plat --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$s"
done
# every carried wheel's requirements are carried too, or on the GPU image (gpu_image_packages.txt)
"${PYTHON:-python3}" benchmarks/gpu_check/closure.py .whl benchmarks/gpu_check/gpu_image_packages.txt
du -sh .whl
# The embedded model's tokenizer and chat template (not its 92 MB weights) for the functional pass
"${PYTHON:-python3}" - <<'PY'
import shutil
from pathlib import Path
from llmkit.core.model.loader.source import resolve_model_dir
dst = Path(".whl/smollm2-tokenizer")
dst.mkdir(parents=True, exist_ok=True)
for f in resolve_model_dir(None).iterdir():
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
        shutil.copy(f, dst / f.name)
print("tokenizer files:", sorted(p.name for p in dst.iterdir()))
PY
