"""A model's recorded kernel set (``so2kernels.precompile``): which one it is, and compiling it.

The server's warm-up, the in-process calculator and an in-process screening run compile the set
up front, several kernels at a time, instead of one kernel at a time at each first launch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
import triton

from service.engine.evaluator import Evaluator
from so2kernels.precompile import PreloadReport, load_kernel_set, preload_kernels

__all__ = ["kernel_set_fingerprint", "preload_recorded_kernels"]

log = logging.getLogger("so2serve.kernels")


def kernel_set_fingerprint(info: Mapping[str, Any]) -> str:
    """Key of a model's recorded kernel set: what decides the kernel variants it launches, i.e.
    the architecture and how it runs, not the weights, the name or which GPU of a host it is
    on. ``info`` is the evaluator's ``info()``."""
    execution = {k: v for k, v in dict(info.get("execution", {})).items() if k != "device"}
    basis = {"config": info.get("config"), "execution": execution}
    return hashlib.sha256(json.dumps(basis, sort_keys=True, default=str).encode()).hexdigest()[:16]


def preload_recorded_kernels(evaluator: Evaluator) -> PreloadReport | None:
    """Compile the kernel set recorded for ``evaluator``'s model on its GPU model (and this
    Triton version); None where there is none, off CUDA, or when preloading fails (logged: the
    kernels then compile at their first launch, as without a record)."""
    try:
        device = torch.device(evaluator.execution.device)
        if device.type != "cuda":
            return None
        gpu = torch.cuda.get_device_name(device)
        fingerprint = kernel_set_fingerprint(evaluator.info())
        specs = load_kernel_set(gpu, fingerprint)
        if not specs:
            log.info(
                "no kernel set recorded for this model (%s) on %s with Triton %s: kernels "
                "compile at their first launch", fingerprint, gpu, triton.__version__,
            )  # fmt: skip
            return None
        report = preload_kernels(specs, device=device.index)
    except Exception:  # an optimisation only: the kernels still compile at their launch
        log.warning("could not preload the recorded kernels", exc_info=True)
        return None
    log.info(
        "compiled %d recorded kernels in %.1f s on %s%s", report.compiled, report.seconds, device,
        f" ({len(report.failed)} left to their first launch)" if report.failed else "",
    )  # fmt: skip
    return report
