"""Typed failures of the evaluation engine; ``service.api.errors`` maps each to an HTTP status.

The engine never knows about HTTP: it raises these, and the API layer chooses the status code
(the code name in the comment is the one the API uses).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class: ``code`` is machine-readable, the message is for humans."""

    code: str = "engine_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFullError(EngineError):
    """The request queue is at its limit (HTTP 503 + Retry-After)."""

    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyAtomsError(EngineError):
    """One structure is above the per-structure atom limit (HTTP 413)."""

    code = "too_many_atoms"

    def __init__(self, *, index: int, n_atoms: int, limit: int) -> None:
        super().__init__(
            f"structures[{index}] has {n_atoms} atoms, above this server's limit of {limit} "
            "atoms per structure (--max-atoms)"
        )
        self.index = index
        self.n_atoms = n_atoms
        self.limit = limit


class StructureTooLargeError(EngineError):
    """A single structure does not fit in device memory even alone (HTTP 507)."""

    code = "out_of_memory"

    def __init__(
        self, *, index: int, n_atoms: int, device: str, estimate: str | None = None
    ) -> None:
        # ``estimate``: a CPU step's own account (needed and available memory), refused before
        # it allocated; a device reports no such figures.
        why = f" ({estimate})" if estimate else ""
        super().__init__(
            f"structures[{index}] ({n_atoms} atoms) does not fit in the memory of {device}, "
            f"even evaluated alone{why}; split the system or use a device with more memory"
        )
        self.index = index
        self.n_atoms = n_atoms
        self.device = device
        self.estimate = estimate


class EvaluationFailedError(EngineError):
    """The model raised an unexpected error on one structure, or on a whole device pass that
    no structure is to blame for (``index`` None) (HTTP 500)."""

    code = "evaluation_failed"

    def __init__(self, *, index: int | None, cause: BaseException) -> None:
        what = "the batch" if index is None else f"structures[{index}]"
        super().__init__(f"evaluating {what} failed: {type(cause).__name__}: {cause}")
        self.index = index


class DeviceFaultError(EngineError):
    """The device itself failed (an illegal address, a lost or reset GPU): CUDA keeps such an
    error in the process's context, so this device can run nothing more until the server
    restarts. No structure is to blame (HTTP 503; /health/ready answers 503 from then on)."""

    code = "device_error"

    def __init__(self, *, device: str, cause: str) -> None:
        super().__init__(
            f"device {device} failed ({cause}) and cannot run passes until the server "
            "restarts; no structure is to blame"
        )
        self.device = device
        self.cause = cause

    def again(self) -> DeviceFaultError:
        """A fresh copy to raise: raising one instance for every request would chain each
        request's frames (its body and structures included) onto its traceback for good."""
        return DeviceFaultError(device=self.device, cause=self.cause)


class EngineClosedError(EngineError):
    """The engine is not running (starting up or shutting down; HTTP 503)."""

    code = "not_ready"
