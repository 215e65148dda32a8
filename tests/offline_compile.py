"""Run a kernel test module's offline sm_90 compile function outside the Triton interpreter.

CI runs under ``TRITON_INTERPRET=1``, which replaces ``triton.compile``; compiling for a real
target therefore happens in a child process whose environment drops that variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KERNEL_TESTS = Path(__file__).resolve().parent / "kernels"
REPO = KERNEL_TESTS.parents[1]


def compiled_count(module: str, call: str) -> int:
    """Import ``tests/kernels/<module>.py`` in a child without the interpreter, evaluate
    ``call`` (e.g. ``"compile_all_for_sm90()"``) and return the integer it prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = (
        f"import sys; sys.path[:0] = [{str(KERNEL_TESTS)!r}, {str(REPO)!r}]; "
        f"import {module} as t; print(t.{call})"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return int(result.stdout.split()[-1])
