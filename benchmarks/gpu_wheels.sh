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
source benchmarks/gpu_pip.sh
# One pip call each for the versions and the downloads.
specs=$(.venv/bin/python -m pip show "${names[@]}" |
  sed -n 's/^Name: //p; s/^Version: /==/p' | paste -d '' - -)
if [ "$(wc -l <<<"$specs")" -ne "${#names[@]}" ]; then
  echo "gpu_wheels.sh: not all of ${names[*]} are installed in .venv" >&2
  exit 1
fi
mkdir -p .whl && rm -f .whl/*.whl
# shellcheck disable=SC2086  # one spec per word
gpu_pip_download .whl "$py" $specs
ls .whl | wc -l
du -sh .whl
