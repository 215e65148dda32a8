"""Model files: ONE ``.safetensors`` file holding the weights and a JSON metadata document.

``__metadata__["so2serve"]`` is a JSON object (format version 2)::

    {"format_version": 2, "config": {...ModelConfig...}, "type_map": [...], "rcut": 6.0,
     "energy_bias": {"O": -93.6, ...}, "provenance": {...},
     "weights_sha256": "...", "model_sha256": "..."}

``weights_sha256`` hashes every tensor (sorted names, dtype, shape, bytes), so a file whose
weights were altered or truncated is rejected. ``model_sha256`` is the model's identity (what
``/info`` and every answer's provenance report): sha256 over a domain tag, ``weights_sha256``
and the canonical JSON of ``config`` (sorted keys, no whitespace), so two files that compute
different energies never share it, and an edited config is rejected. ``type_map``, ``rcut`` and
``energy_bias`` repeat the config and the ``energy_bias`` tensor for readers without torch; a
file where they disagree is rejected. ``provenance`` is informational and covered by no hash.

Version 1 files (no ``model_sha256``: their config is covered by no hash) still load; their
identity is derived on load by the same formula. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor

from service.model.config import ModelConfig
from service.model.dpa4 import DPA4Model
from service.model.errors import ModelConfigError, ModelFileError

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
METADATA_KEY = "so2serve"
_MODEL_HASH_TAG = b"so2serve-model\n"
_COMMON_KEYS = ("config", "type_map", "rcut", "energy_bias", "provenance", "weights_sha256")


def weights_hash(tensors: dict[str, Tensor]) -> str:
    """sha256 over sorted (name, dtype, shape, bytes) of every tensor."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        raw = t.reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()


def canonical_config_json(config: dict[str, Any]) -> str:
    """The config document as hashed: sorted keys, no whitespace, ASCII."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def model_hash(weights_sha256: str, config: dict[str, Any]) -> str:
    """The model's identity: sha256 over a tag, the weights hash and the canonical config."""
    digest = hashlib.sha256(_MODEL_HASH_TAG)
    digest.update(weights_sha256.encode())
    digest.update(b"\n")
    digest.update(canonical_config_json(config).encode())
    return digest.hexdigest()


def save_model(
    model: DPA4Model, path: str | Path, *, provenance: dict[str, Any] | None = None
) -> str:
    """Write ``model`` to ``path``; returns its identity (``model_sha256``).

    ``provenance=None`` keeps the provenance of the file ``model`` was loaded from, if any.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights_digest = weights_hash(tensors)
    cfg = model.config
    # Hash the config exactly as a reader will parse it back from the JSON text.
    config_document = json.loads(json.dumps(cfg.to_dict()))
    model_digest = model_hash(weights_digest, config_document)
    if provenance is None:
        provenance = dict((model.file_metadata or {}).get("provenance", {}))
    bias = model.energy_bias.detach().cpu().tolist()
    document = {
        "format_version": FORMAT_VERSION,
        "config": config_document,
        "type_map": list(cfg.type_map),
        "rcut": cfg.rcut,
        "energy_bias": dict(zip(cfg.type_map, bias, strict=True)),
        "provenance": provenance,
        "weights_sha256": weights_digest,
        "model_sha256": model_digest,
    }
    payload = save(tensors, metadata={METADATA_KEY: json.dumps(document)})
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed over it, so a reader (or a crash) never meets half a
    # file; plain write_bytes also honours the umask, where safetensors' save_file makes 0600.
    partial = target.with_name(target.name + ".partial")
    try:
        partial.write_bytes(payload)
        os.replace(partial, target)
    except OSError:
        partial.unlink(missing_ok=True)  # a failed save leaves nothing behind
        raise
    return model_digest


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The validated metadata document of a model file, without reading any tensor.

    The config, ``type_map``, ``rcut`` and ``model_sha256`` are checked against each other;
    the weights (hence ``weights_sha256`` and ``energy_bias``) only by :func:`load_model`.
    The returned document always carries ``model_sha256`` (derived for version 1 files).
    """
    file = Path(path)
    raw, _ = _open(file, load_tensors=False)
    document, _ = _validated_document(file, raw)
    return document


def load_model(path: str | Path) -> DPA4Model:
    """Load and validate a model file; raises :class:`ModelFileError` with the reason.

    The model's ``file_metadata`` is the validated document, ``model_sha256`` included.
    """
    file = Path(path)
    raw, tensors = _open(file, load_tensors=True)
    document, config = _validated_document(file, raw)
    if weights_hash(tensors) != document["weights_sha256"]:
        raise ModelFileError(f"{file}: weights do not match their recorded hash (corrupted file)")
    _check_finite(file, tensors)
    model = _build(file, config)
    _check_tensors_fit(file, tensors, model.state_dict())
    _check_energy_bias(file, document["energy_bias"], config, tensors["energy_bias"])
    model.load_state_dict(tensors)
    model.eval()
    model.file_metadata = document
    return model


def _open(path: Path, *, load_tensors: bool) -> tuple[str, dict[str, Tensor]]:
    """The raw metadata JSON and, when asked, every tensor of a safetensors file."""
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    tensors: dict[str, Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = (fh.metadata() or {}).get(METADATA_KEY)
            if load_tensors:
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors model file ({exc})") from exc
    if raw is None:
        raise ModelFileError(f"{path}: no so2serve metadata (not an so2serve model file)")
    return raw, tensors


def _validated_document(path: Path, raw: str) -> tuple[dict[str, Any], ModelConfig]:
    """Parse and cross-check the metadata document; adds the derived ``model_sha256`` to a
    version 1 document."""
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: metadata is not valid JSON ({exc})") from exc
    if not isinstance(document, dict):
        raise ModelFileError(f"{path}: metadata must be a JSON object")
    version = document.get("format_version")
    if isinstance(version, bool) or version not in READABLE_FORMAT_VERSIONS:
        readable = ", ".join(str(v) for v in READABLE_FORMAT_VERSIONS)
        raise ModelFileError(
            f"{path}: unsupported model file format_version {version!r} (this build reads "
            f"{readable})"
        )
    required = _COMMON_KEYS + (("model_sha256",) if version >= 2 else ())
    for key in required:
        if key not in document:
            raise ModelFileError(f"{path}: metadata lacks {key!r}")
    if not isinstance(document["config"], dict):
        raise ModelFileError(f"{path}: metadata 'config' must be a JSON object")
    if not isinstance(document["provenance"], dict):
        raise ModelFileError(f"{path}: metadata 'provenance' must be a JSON object")
    if not _is_sha256(document["weights_sha256"]):
        raise ModelFileError(f"{path}: metadata 'weights_sha256' is not a sha256 hex digest")
    identity = model_hash(document["weights_sha256"], document["config"])
    if version >= 2 and document["model_sha256"] != identity:
        raise ModelFileError(
            f"{path}: config or weights hash do not match the recorded model_sha256 "
            "(edited or corrupted metadata)"
        )
    document["model_sha256"] = identity
    try:
        config = ModelConfig.from_dict(document["config"])
    except ModelConfigError as exc:
        raise ModelFileError(f"{path}: invalid model config: {exc}") from exc
    _check_summary(path, document, config)
    return document, config


def _is_sha256(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_summary(path: Path, document: dict[str, Any], config: ModelConfig) -> None:
    """The top-level ``type_map``/``rcut``/``energy_bias`` must restate the config."""
    if document["type_map"] != list(config.type_map):
        raise ModelFileError(
            f"{path}: metadata type_map {document['type_map']!r} disagrees with the config's "
            f"{list(config.type_map)!r}"
        )
    rcut = document["rcut"]
    if not _is_number(rcut) or float(rcut) != config.rcut:
        raise ModelFileError(
            f"{path}: metadata rcut {rcut!r} disagrees with the config's {config.rcut!r}"
        )
    bias = document["energy_bias"]
    if (
        not isinstance(bias, dict)
        or sorted(bias) != sorted(config.type_map)
        or not all(_is_number(v) for v in bias.values())
    ):
        raise ModelFileError(
            f"{path}: metadata energy_bias {bias!r} must map each of {list(config.type_map)!r} "
            "to a number"
        )


def _check_finite(path: Path, tensors: dict[str, Tensor]) -> None:
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelFileError(f"{path}: tensor {name} holds NaN or inf values")


def _build(path: Path, config: ModelConfig) -> DPA4Model:
    """An untrained model of ``config``; a config the validation let through but the network
    cannot be built from is still the file's fault, not a server error."""
    try:
        return DPA4Model(config)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: cannot build a model from its config ({exc})") from exc


def _check_tensors_fit(path: Path, tensors: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
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


def _check_energy_bias(
    path: Path, recorded: dict[str, float], config: ModelConfig, tensor: Tensor
) -> None:
    """The metadata's ``energy_bias`` is a bit-exact copy of the tensor (JSON floats
    round-trip), so any difference is an edit."""
    for symbol, value in zip(config.type_map, tensor.tolist(), strict=True):
        if float(recorded[symbol]) != value:
            raise ModelFileError(
                f"{path}: metadata energy_bias[{symbol!r}] = {recorded[symbol]!r} disagrees "
                f"with the energy_bias tensor ({value!r})"
            )
