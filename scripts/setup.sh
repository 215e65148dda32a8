#!/usr/bin/env bash
# Creates .venv and installs so2serve into it, with plotting (the `plot` extra, for `eval --plot`);
# `--dev` adds the test tools.
# torch is installed first, pinned, so that pip takes the local CPU wheel where one exists
# instead of resolving a multi-GB CUDA build; an existing .venv with torch 2.11-2.13 keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") extras="[plot]" ;;
  --dev) extras="[dev]" ;;
  *) echo "usage: $0 [--dev]" >&2; exit 2 ;;
esac
# Checked first (for a new .venv and an existing one): pip would only refuse the package after
# installing torch.
require_311() {
  if ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: so2serve needs Python >= 3.11, $2 is $("$1" --version 2>&1)" >&2
    exit 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  require_311 python3 "python3"
  python3 -m venv .venv
fi
py=.venv/bin/python
require_311 "$py" ".venv (remove it to start over)"
"$py" -m pip install -q --upgrade pip >/dev/null
if ! "$py" -c 'import torch, sys; v=tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])); sys.exit(not ((2,11) <= v <= (2,13)))' 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q -e ".${extras}"
