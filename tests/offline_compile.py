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


def run_without_interpreter(script: str) -> str:
    """Run Python ``script`` in a child process without ``TRITON_INTERPRET`` (the repository on
    its path) and return its stdout; a failing child fails the calling test with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n{script}"],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def compiled_count(module: str, call: str) -> int:
    """Import ``tests/kernels/<module>.py`` in a child without the interpreter, evaluate
    ``call`` (e.g. ``"compile_all_for_sm90()"``) and return the integer it prints."""
    script = f"sys.path.insert(0, {str(KERNEL_TESTS)!r})\nimport {module} as t\nprint(t.{call})"
    return int(run_without_interpreter(script).split()[-1])
