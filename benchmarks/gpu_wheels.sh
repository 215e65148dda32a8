#!/usr/bin/env bash
# Wheels of the packages so2serve needs that the GPU box's image lacks (the image has torch,
# Triton, numpy, scipy, httpx, msgpack, rich, typer, safetensors, prometheus-client, ...), at the
# versions this checkout's .venv runs, into .whl/ for gpu.sh (carry it: ~7 MB). The list was read
# off the image's package list (2026-12-02); a ModuleNotFoundError there names one to add.
#   benchmarks/gpu_wheels.sh [cp312]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-cp312}
names=(ase vesin pydantic pydantic_core pydantic-settings python-dotenv typing-inspection
  annotated-types fastapi starlette opentelemetry-api uvicorn httptools websockets orjson)
mkdir -p .whl && rm -f .whl/*.whl
for name in "${names[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "gpu_wheels.sh: $name is not installed in .venv" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp \
    --python-version "${py#cp}" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$name==$version" 2>&1 | grep -v '^WARNING' || true
done
ls .whl | wc -l
du -sh .whl
