"""Model-file integrity: the identity covers the config, the metadata restates the weights,
non-finite or malformed content is a ModelFileError, metadata reads touch no tensor, and
version 1 files (the format before ``model_sha256``) keep loading."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

import service.model.io as model_io
from service.model.config import ModelConfig, preset
from service.model.dpa4 import DPA4Model
from service.model.errors import ModelConfigError, ModelFileError
from service.model.io import (
    FORMAT_VERSION,
    load_model,
    model_hash,
    read_metadata,
    save_model,
    weights_hash,
)
from service.model.potential import default_model_path, load_potential

Edit = Callable[[dict[str, Any], dict[str, Tensor]], None]


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = DPA4Model(preset("tiny", ["O", "H"], n_blocks=1, n_radial=4))
    with torch.no_grad():
        model.energy_bias.copy_(torch.tensor([-93.25, -187.5], dtype=torch.float64))
    path = tmp_path_factory.mktemp("model") / "good.safetensors"
    save_model(model, path, provenance={"note": "integrity test"})
    return path


def _contents(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    with safe_open(str(path), framework="pt") as fh:
        document = json.loads(fh.metadata()["so2serve"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (not a dict)
    return document, tensors


def _rewritten(src: Path, dst: Path, edit: Edit, *, rehash: bool = True) -> Path:
    """``src`` with ``edit`` applied; ``rehash`` recomputes both hashes, as a tamperer (or a
    careless tool) would, so that only the other checks stand between the edit and a load."""
    document, tensors = _contents(src)
    edit(document, tensors)
    if rehash:
        document["weights_sha256"] = weights_hash(tensors)
        if isinstance(document.get("config"), dict):
            document["model_sha256"] = model_hash(document["weights_sha256"], document["config"])
    save_file(tensors, str(dst), metadata={"so2serve": json.dumps(document)})
    return dst


def _set_config(**fields: Any) -> Edit:
    def edit(document: dict[str, Any], _: dict[str, Tensor]) -> None:
        document["config"].update(fields)

    return edit


def _set_top_level(**fields: Any) -> Edit:
    def edit(document: dict[str, Any], _: dict[str, Tensor]) -> None:
        document.update(fields)

    return edit


def _chain(*edits: Edit) -> Edit:
    def edit(document: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        for step in edits:
            step(document, tensors)

    return edit


def _swap_type_map(document: dict[str, Any], _: dict[str, Tensor]) -> None:
    """Relabel the elements consistently everywhere: a valid file of a different model."""
    bias_in_tensor_order = [document["energy_bias"][s] for s in document["type_map"]]
    document["config"]["type_map"] = ["H", "O"]
    document["type_map"] = ["H", "O"]
    document["energy_bias"] = dict(zip(["H", "O"], bias_in_tensor_order, strict=True))


def test_saved_file_records_the_model_identity(good_file: Path) -> None:
    document = read_metadata(good_file)
    assert document["format_version"] == FORMAT_VERSION == 2
    assert document["model_sha256"] == model_hash(document["weights_sha256"], document["config"])
    assert document["model_sha256"] != document["weights_sha256"]
    assert load_model(good_file).file_metadata == document


@pytest.mark.parametrize(
    "edit",
    [_swap_type_map, _set_config(rcut=4.0), _set_config(extra={"note": "edited"})],
    ids=["type_map_swapped", "rcut_4", "annotation"],
)
def test_an_edited_config_is_rejected(good_file: Path, tmp_path: Path, edit: Edit) -> None:
    def edit_config_only(document: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        edit(document, tensors)
        document["rcut"] = document["config"]["rcut"]  # a consistent summary: only the hash

    edited = _rewritten(good_file, tmp_path / "edited.safetensors", edit_config_only, rehash=False)
    with pytest.raises(ModelFileError, match="model_sha256"):
        read_metadata(edited)
    with pytest.raises(ModelFileError, match="model_sha256"):
        load_model(edited)


def test_a_different_config_is_a_different_identity(good_file: Path, tmp_path: Path) -> None:
    """Same weights, another config: the file loads (hashes recomputed) but is not the same
    model, so it must not report the same identity."""
    original = read_metadata(good_file)
    edits = {
        "swapped": _swap_type_map,
        "rcut": _chain(_set_config(rcut=4.0), _set_top_level(rcut=4.0)),
    }
    for name, edit in edits.items():
        other = _rewritten(good_file, tmp_path / f"{name}.safetensors", edit)
        loaded = load_model(other)
        assert loaded.file_metadata is not None
        assert loaded.file_metadata["weights_sha256"] == original["weights_sha256"]
        assert loaded.file_metadata["model_sha256"] != original["model_sha256"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_top_level(type_map=["H", "O"]), "type_map"),
        (_set_top_level(type_map=["O"]), "type_map"),
        (_set_top_level(rcut=4.0), "rcut"),
        (_set_top_level(rcut=True), "rcut"),
        (_set_top_level(energy_bias={"O": -93.25}), "energy_bias"),
        (_set_top_level(energy_bias={"O": -93.25, "H": "x"}), "energy_bias"),
    ],
    ids=["type_map_swapped", "type_map_short", "rcut", "rcut_bool", "bias_short", "bias_text"],
)
def test_a_summary_disagreeing_with_the_config_is_rejected(
    good_file: Path, tmp_path: Path, edit: Edit, message: str
) -> None:
    bad = _rewritten(good_file, tmp_path / "bad.safetensors", edit)
    with pytest.raises(ModelFileError, match=message):
        read_metadata(bad)


def test_an_energy_bias_disagreeing_with_the_tensor_is_rejected(
    good_file: Path, tmp_path: Path
) -> None:
    def shift_recorded_bias(document: dict[str, Any], _: dict[str, Tensor]) -> None:
        document["energy_bias"]["H"] += 1e-9

    def shift_tensor(_: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        tensors["energy_bias"] = tensors["energy_bias"] + torch.tensor([0.0, 1.0]).double()

    for name, edit in (("recorded", shift_recorded_bias), ("tensor", shift_tensor)):
        bad = _rewritten(good_file, tmp_path / f"{name}.safetensors", edit)
        with pytest.raises(ModelFileError, match=r"energy_bias\['H'\].*tensor"):
            load_model(bad)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_rejected(good_file: Path, tmp_path: Path, value: float) -> None:
    _, tensors = _contents(good_file)
    name = next(k for k in sorted(tensors) if k != "energy_bias" and tensors[k].numel() > 1)

    def poison(_: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[1] = value

    bad = _rewritten(good_file, tmp_path / "poisoned.safetensors", poison)
    with pytest.raises(ModelFileError, match=rf"tensor {re.escape(name)} holds NaN or inf"):
        load_model(bad)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set_config(channels=64.5), "channels must be an integer"),
        (_set_config(lmax=True), "lmax must be an integer"),
        (_set_config(fitting_neurons=[0.5]), "fitting_neurons must be a list of integers"),
        (_set_config(type_map="OH"), "type_map must be a list"),
        (_set_config(use_env_seed=1), "use_env_seed"),
        (_set_config(eps=math.inf), "eps"),
        (_set_config(basis=["bessel"]), "basis"),
        (_set_top_level(config=[1]), "'config' must be a JSON object"),
        (_set_top_level(provenance=[1]), "'provenance' must be a JSON object"),
    ],
    ids=[
        "channels_float", "lmax_bool", "neurons_float", "type_map_str", "env_seed_int",
        "eps_inf", "basis_list", "config_list", "provenance_list",
    ],
)  # fmt: skip
def test_malformed_metadata_is_a_model_file_error(
    good_file: Path, tmp_path: Path, edit: Edit, message: str
) -> None:
    # Hashes recomputed: the structure and config checks, not the identity, must catch these.
    bad = _rewritten(good_file, tmp_path / "malformed.safetensors", edit)
    with pytest.raises(ModelFileError, match=message):
        load_model(bad)


def test_a_malformed_weights_hash_is_rejected(good_file: Path, tmp_path: Path) -> None:
    bad = _rewritten(
        good_file, tmp_path / "bad.safetensors", _set_top_level(weights_sha256=7), rehash=False
    )
    with pytest.raises(ModelFileError, match="weights_sha256"):
        read_metadata(bad)


def test_config_validation_checks_field_types() -> None:
    base = preset("tiny", ["O", "H"]).to_dict()
    with pytest.raises(ModelConfigError, match=r"channels must be an integer, got 64\.5"):
        ModelConfig.from_dict({**base, "channels": 64.5})
    with pytest.raises(ModelConfigError, match="must be an object"):
        ModelConfig.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(ModelConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**base, 1: 2})
    # JSON integers where reals belong are fine, and normalised so equality and JSON agree.
    integral = ModelConfig.from_dict({**base, "rcut": 6})
    assert integral == preset("tiny", ["O", "H"]) and isinstance(integral.rcut, float)


def test_read_metadata_reads_no_tensor(good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real_open = model_io.safe_open

    class CountingHandle:
        def __init__(self, handle: Any) -> None:
            self._handle = handle

        def __enter__(self) -> CountingHandle:
            self._handle.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._handle.__exit__(*exc)

        def __getattr__(self, name: str) -> Any:
            if name in ("get_tensor", "get_slice"):
                reads.append(name)
            return getattr(self._handle, name)

    monkeypatch.setattr(model_io, "safe_open", lambda *a, **k: CountingHandle(real_open(*a, **k)))
    read_metadata(good_file)
    assert reads == []
    load_model(good_file)
    assert reads.count("get_tensor") == len(_contents(good_file)[1])


def test_resaving_keeps_provenance_and_identity(good_file: Path, tmp_path: Path) -> None:
    loaded = load_model(good_file)
    copy = tmp_path / "copy.safetensors"
    identity = save_model(loaded, copy)
    assert identity == read_metadata(good_file)["model_sha256"]
    assert read_metadata(copy)["provenance"] == {"note": "integrity test"}
    save_model(loaded, copy, provenance={"note": "explicit"})
    assert read_metadata(copy)["provenance"] == {"note": "explicit"}
    save_model(DPA4Model(loaded.config), copy)
    assert read_metadata(copy)["provenance"] == {}


def test_saved_files_honour_the_umask(good_file: Path, tmp_path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    target = tmp_path / "m.safetensors"
    save_model(load_model(good_file), target)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def _as_version_1(document: dict[str, Any], _: dict[str, Tensor]) -> None:
    document["format_version"] = 1
    del document["model_sha256"]


def test_version_1_files_still_load(good_file: Path, tmp_path: Path) -> None:
    old = _rewritten(good_file, tmp_path / "v1.safetensors", _as_version_1, rehash=False)
    document = read_metadata(old)
    assert document["format_version"] == 1
    assert document["model_sha256"] == read_metadata(good_file)["model_sha256"]
    loaded = load_model(old)
    assert loaded.file_metadata == document
    # Version 1 still gets the summary, tensor and finiteness checks.
    bad = _rewritten(old, tmp_path / "v1_bad.safetensors", _set_top_level(rcut=4.0))
    with pytest.raises(ModelFileError, match="rcut"):
        load_model(bad)
    # ... and re-saving upgrades it to the current version with the same identity.
    upgraded = tmp_path / "v2.safetensors"
    assert save_model(loaded, upgraded) == document["model_sha256"]
    assert read_metadata(upgraded)["format_version"] == FORMAT_VERSION


def test_the_shipped_default_model_carries_the_model_hash() -> None:
    path = default_model_path()
    if not path.is_file():
        pytest.skip("no default model shipped")
    document = read_metadata(path)
    assert document["format_version"] == FORMAT_VERSION
    model = load_model(path)
    assert model.file_metadata is not None
    assert model.file_metadata["model_sha256"] == document["model_sha256"]


def test_the_reported_identity_is_the_model_hash(good_file: Path) -> None:
    potential = load_potential(good_file, device="cpu", path="reference")
    assert potential.info()["sha256"] == read_metadata(good_file)["model_sha256"]
