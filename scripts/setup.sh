#!/usr/bin/env bash
# Creates .venv and installs so2serve into it. `--dev` adds the test tools.
# torch is installed first, pinned, so that pip takes the local CPU wheel where one exists
# instead of resolving a multi-GB CUDA build; an existing .venv with torch 2.11-2.13 keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c 'import torch, sys; v=tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])); sys.exit(not ((2,11) <= v <= (2,13)))' 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e ".${extras}"
