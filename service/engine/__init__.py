"""The evaluation engine: admission, dynamic batching, the device worker and metrics."""

from service.engine.batcher import BatchLimits, Engine, EvaluationResult, EvaluationTimings
from service.engine.errors import (
    DeviceFaultError,
    EngineClosedError,
    EngineError,
    EvaluationFailedError,
    QueueFullError,
    StructureTooLargeError,
    TooManyAtomsError,
)
from service.engine.evaluator import Evaluator
from service.engine.metrics import ServiceMetrics
from service.engine.worker import BatchOutput, Worker

__all__ = [
    "BatchLimits",
    "BatchOutput",
    "DeviceFaultError",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EvaluationFailedError",
    "EvaluationResult",
    "EvaluationTimings",
    "Evaluator",
    "QueueFullError",
    "ServiceMetrics",
    "StructureTooLargeError",
    "TooManyAtomsError",
    "Worker",
]
