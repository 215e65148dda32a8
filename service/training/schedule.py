"""Learning-rate schedule and loss-weight schedule, as pure functions of training progress.

Both depend only on ``progress = step / steps`` (or elapsed / budget in wall-clock mode), so a
resumed run needs nothing but the step count to be back on the same curve (a resume with
another ``run.steps`` lands on another point of it).
"""

from __future__ import annotations

import math

from service.training.config import LossConfig, OptimConfig

__all__ = ["WARMUP_START", "LossWeights", "decay_factor", "learning_rate", "loss_weights"]


def decay_factor(progress: float, optim: OptimConfig) -> float:
    """The post-warm-up LR multiplier ∈ [min_lr_ratio, 1] at ``progress`` ∈ [0, 1].

    ``cosine`` decays over everything after warm-up; ``wsd`` holds 1 and applies the same cosine
    only over the last ``decay_fraction``; ``constant`` holds 1.
    """
    p = min(max(progress, 0.0), 1.0)
    if optim.schedule == "constant":
        return 1.0
    warmup = optim.warmup_fraction
    start = warmup if optim.schedule == "cosine" else max(warmup, 1.0 - optim.decay_fraction)
    if p <= start:
        return 1.0
    t = (p - start) / (1.0 - start)
    floor = optim.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


WARMUP_START = 1e-3
"""The warm-up's first LR as a fraction of the peak (not 0: the first step must move)."""


def learning_rate(progress: float, optim: OptimConfig) -> float:
    """LR at ``progress``: a linear warm-up from ``WARMUP_START`` (0.1 %) of the peak at
    progress 0 to the peak at ``warmup_fraction``, times :func:`decay_factor`."""
    p = min(max(progress, 0.0), 1.0)
    warmup = optim.warmup_fraction
    ramp = 1.0 if p >= warmup else WARMUP_START + (1.0 - WARMUP_START) * p / warmup
    return optim.lr * ramp * decay_factor(p, optim)


LossWeights = tuple[float, float, float]
"""(energy, forces, virial) weights."""


def loss_weights(progress: float, optim: OptimConfig, loss: LossConfig) -> LossWeights:
    """Weights moving from ``start`` to ``end`` as the LR decays from its peak to its floor.

    DeePMD's recipe: forces dominate early, energy catches up as the LR decays. Warm-up counts
    as peak (start weights); a ``constant`` schedule keeps the start weights throughout.
    """
    floor = optim.min_lr_ratio
    factor = decay_factor(progress, optim)
    s = 1.0 if floor >= 1.0 else (factor - floor) / (1.0 - floor)

    def mix(pair: list[float]) -> float:
        return pair[1] + (pair[0] - pair[1]) * s

    return mix(loss.energy_weight), mix(loss.force_weight), mix(loss.virial_weight)
