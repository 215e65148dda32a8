"""Training state that must survive a restart: batch order, EMA weights, checkpoint file.

A checkpoint holds plain tensors, numbers and strings only, so it loads with
``torch.load(weights_only=True)`` (no pickled code). Resuming restores model, optimizer, EMA,
batch sampler, RNG states and the step counter; the schedule is a pure function of the step,
so the continued run is the same as an uninterrupted one (bitwise on CPU), unless the resume
changes one of the settings it allows to change (the LR, the clip, the batch size, the run's
length: ``loop._RESUME_MAY_RETUNE``), which it logs.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from service.training.config import ConfigError

__all__ = [
    "CHECKPOINT_FORMAT",
    "EpochSampler",
    "ExponentialMovingAverage",
    "file_problem",
    "folder_problem",
    "load_checkpoint",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = 1

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be written into ``folder`` (created if missing), or None: checked
    before a long run rather than found at its end."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create folder {folder} ({exc})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable"
    return None


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file (its folder created if missing), or None."""
    problem = folder_problem(path.parent)
    if problem is None and path.is_dir():
        problem = "it is a folder"
    elif problem is None and path.exists() and not os.access(path, os.W_OK):
        problem = "permission denied"
    return problem


class EpochSampler:
    """Frame indices in batches: a fresh random permutation per epoch, from its own generator.

    The last batch of an epoch may be smaller. State = generator state + current permutation +
    cursor, so the order continues exactly after a resume.
    """

    def __init__(self, n_frames: int, batch_size: int, seed: int) -> None:
        if n_frames < 1:
            raise ValueError("no training frames")
        self.n_frames = n_frames
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.permutation = torch.randperm(n_frames, generator=self.generator)
        self.cursor = 0

    def next_batch(self) -> list[int]:
        if self.cursor >= self.n_frames:
            self.epoch += 1
            self.permutation = torch.randperm(self.n_frames, generator=self.generator)
            self.cursor = 0
        end = min(self.cursor + self.batch_size, self.n_frames)
        indices = self.permutation[self.cursor : end].tolist()
        self.cursor = end
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "epoch": self.epoch,
            "permutation": self.permutation.clone(),
            "cursor": self.cursor,
            "n_frames": self.n_frames,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["n_frames"]) != self.n_frames:
            raise ConfigError(
                f"cannot resume: the checkpoint was made with {state['n_frames']} training "
                f"frames, the data now has {self.n_frames} (the data changed since)"
            )
        self.generator.set_state(state["generator"])
        self.epoch = int(state["epoch"])
        self.permutation = state["permutation"].clone()
        self.cursor = int(state["cursor"])


class ExponentialMovingAverage(Generic[ModuleT]):
    """EMA copy of a module's parameters (buffers are copied verbatim).

    The effective decay ramps as ``min(decay, (1 + k)/(10 + k))`` over update count ``k`` so that
    the first updates are not dominated by the random initialisation.
    """

    def __init__(self, source: ModuleT, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(source)
        self.module.requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, source: nn.Module) -> None:
        decay = min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))
        for ema_param, param in zip(self.module.parameters(), source.parameters(), strict=True):
            ema_param.lerp_(param.detach(), 1.0 - decay)
        for ema_buffer, buffer in zip(self.module.buffers(), source.buffers(), strict=True):
            ema_buffer.copy_(buffer)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write atomically (temp file + rename): a crash mid-write leaves the previous one intact."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's state; :class:`ConfigError` if unreadable or of another format."""
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"{path}: cannot read the checkpoint ({exc})") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise ConfigError(f"{path}: checkpoint format {found!r}, expected {CHECKPOINT_FORMAT}")
    return state
