"""Model files: ONE ``.safetensors`` file holding the weights and a JSON metadata document.

``__metadata__["so2serve"]`` is a JSON object::

    {"format_version": 1, "config": {...ModelConfig...}, "type_map": [...], "rcut": 6.0,
     "energy_bias": {"O": -93.6, ...}, "provenance": {...}, "weights_sha256": "..."}

``weights_sha256`` hashes every tensor (sorted names, dtype, shape, bytes), so a file whose
weights were altered or truncated is rejected. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model
from service.model.errors import ModelConfigError, ModelFileError

FORMAT_VERSION = 1
METADATA_KEY = "so2serve"


def weights_hash(tensors: dict[str, Tensor]) -> str:
    """sha256 over sorted (name, dtype, shape, bytes) of every tensor."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        raw = t.reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


def save_model(
    model: DPA4Model, path: str | Path, *, provenance: dict[str, Any] | None = None
) -> str:
    """Write ``model`` to ``path``; returns the weights hash recorded in the file."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    digest = weights_hash(tensors)
    cfg = model.config
    bias = model.energy_bias.detach().cpu().tolist()
    document = {
        "format_version": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "type_map": list(cfg.type_map),
        "rcut": cfg.rcut,
        "energy_bias": dict(zip(cfg.type_map, bias, strict=True)),
        "provenance": provenance or {},
        "weights_sha256": digest,
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target), metadata={METADATA_KEY: json.dumps(document)})
    return digest


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The validated metadata document of a model file (weights not loaded)."""
    document, _ = _read(Path(path), load_tensors=False)
    return document


def load_model(path: str | Path) -> DPA4Model:
    """Load and validate a model file; raises :class:`ModelFileError` with the reason."""
    document, tensors = _read(Path(path), load_tensors=True)
    try:
        config = ModelConfig.from_dict(document["config"])
    except ModelConfigError as exc:
        raise ModelFileError(f"{path}: invalid model config: {exc}") from exc
    model = DPA4Model(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelFileError(
            f"{path}: weights do not fit the config "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    for key, value in tensors.items():
        if value.shape != expected[key].shape or value.dtype != expected[key].dtype:
            raise ModelFileError(
                f"{path}: tensor {key} is {tuple(value.shape)} {value.dtype}, "
                f"expected {tuple(expected[key].shape)} {expected[key].dtype}"
            )
    model.load_state_dict(tensors)
    model.eval()
    model.file_metadata = document
    return model


def _read(path: Path, *, load_tensors: bool) -> tuple[dict[str, Any], dict[str, Tensor]]:
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = (fh.metadata() or {}).get(METADATA_KEY)
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a dict) if load_tensors else {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors model file ({exc})") from exc
    if raw is None:
        raise ModelFileError(f"{path}: no so2serve metadata (not an so2serve model file)")
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: metadata is not valid JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise ModelFileError(f"{path}: metadata must be a JSON object")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelFileError(
            f"{path}: unsupported model file format_version {version!r} "
            f"(this build reads {FORMAT_VERSION})"
        )
    for key in ("config", "weights_sha256"):
        if key not in document:
            raise ModelFileError(f"{path}: metadata lacks {key!r}")
    if load_tensors and weights_hash(tensors) != document["weights_sha256"]:
        raise ModelFileError(f"{path}: weights do not match their recorded hash (corrupted file)")
    return document, tensors
