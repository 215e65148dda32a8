"""Model files (round trip, rejection of bad files) and DeePMD import (subset checks)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.model.config import ModelConfig, preset
from service.model.deepmd_import import import_deepmd_checkpoint, load_deepmd_checkpoint
from service.model.dpa4 import DPA4Model
from service.model.errors import ModelConfigError, ModelFileError, UnsupportedCheckpointError
from service.model.io import load_model, read_metadata, save_model
from tests.model.golden import golden_file, triclinic_cache


def _energy(model: DPA4Model) -> torch.Tensor:
    cache, _ = triclinic_cache()
    with torch.no_grad():
        return model(torch.tensor([0, 1, 1]), cache)


def test_presets_and_json_round_trip() -> None:
    for name in ("tiny", "small", "medium", "large"):
        cfg = preset(name, ["O", "H"])
        assert ModelConfig.from_json(cfg.to_json()) == cfg
        assert cfg.fused_eligible
    assert preset("tiny", ["O", "H"]).ffn_hidden == 96


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"lmax": 0}, "lmax"),
        ({"n_atten_head": 3}, "n_atten_head"),
        ({"radial_so2_rank": 7}, "radial_so2_rank"),
        ({"type_map": ("O", "Xx")}, "type_map"),
        ({"ffn": "grid"}, "ffn"),
        ({"version": 2.0}, "version"),
    ],
)
def test_config_validation_names_the_field(override: dict[str, object], field: str) -> None:
    base = preset("tiny", ["O", "H"]).to_dict()
    base.update(override)
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict(base)
    with pytest.raises(ModelConfigError, match="unknown"):
        ModelConfig.from_dict({**preset("tiny", ["O"]).to_dict(), "bogus": 1})


def test_import_round_trip(tmp_path: Path) -> None:
    dst = tmp_path / "tiny.safetensors"
    cfg = import_deepmd_checkpoint(golden_file("tiny_fused_s2.pt"), dst)
    assert cfg.ffn == "s2" and cfg.version == 1.1 and cfg.n_focus == 4
    original, _ = load_deepmd_checkpoint(golden_file("tiny_fused_s2.pt"))
    loaded = load_model(dst)
    assert loaded.config == original.config
    assert torch.equal(_energy(loaded), _energy(original))
    meta = read_metadata(dst)
    assert meta["provenance"]["source"] == "deepmd-kit"
    assert len(meta["provenance"]["source_sha256"]) == 64
    assert set(meta["energy_bias"]) == {"O", "H"}


def test_bad_model_files_are_rejected(tmp_path: Path) -> None:
    model = DPA4Model(preset("tiny", ["O", "H"]))
    good = tmp_path / "m.safetensors"
    save_model(model, good, provenance={"note": "test"})
    load_model(good)

    with pytest.raises(ModelFileError, match="not found"):
        load_model(tmp_path / "missing.safetensors")

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-1000])
    with pytest.raises(ModelFileError):
        load_model(truncated)

    flipped = bytearray(good.read_bytes())
    flipped[-5] ^= 0xFF  # a weight byte: the content hash must catch it
    corrupted = tmp_path / "corrupted.safetensors"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(ModelFileError, match="hash"):
        load_model(corrupted)

    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    doc = json.loads(read_metadata_raw(good))
    doc["format_version"] = 99
    wrong = tmp_path / "wrong_version.safetensors"
    save_file(tensors, str(wrong), metadata={"so2serve": json.dumps(doc)})
    with pytest.raises(ModelFileError, match="format_version"):
        load_model(wrong)

    bare = tmp_path / "bare.safetensors"
    save_file(tensors, str(bare))
    with pytest.raises(ModelFileError, match="metadata"):
        load_model(bare)


def read_metadata_raw(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return str(fh.metadata()["so2serve"])


def _checkpoint_with(tmp_path: Path, edit: dict[str, object], section: str = "descriptor") -> Path:
    ckpt = torch.load(golden_file("tiny_fused_plain.pt"), weights_only=True)
    state = copy.deepcopy(ckpt)
    params = state["model"]["_extra_state"]["model_params"]
    target = params if section == "model" else params[section]
    target.update(edit)
    out = tmp_path / "edited.pt"
    torch.save(state, out)
    return out


@pytest.mark.parametrize(
    ("edit", "section", "option"),
    [
        ({"message_node_so3": True}, "descriptor", "message_node_so3"),
        ({"ffn_so3_grid": True}, "descriptor", "ffn_so3_grid"),
        ({"so3_readout": "mlp"}, "descriptor", "so3_readout"),
        ({"l_schedule": [2, 1]}, "descriptor", "l_schedule"),
        ({"edge_norm": True}, "descriptor", "edge_norm"),
        ({"s2_activation": [True, True]}, "descriptor", "s2_activation"),
        ({"bridging_method": "zbl"}, "model", "bridging_method"),
        ({"numb_fparam": 2}, "fitting_net", "numb_fparam"),
    ],
)
def test_unsupported_options_are_refused(
    tmp_path: Path, edit: dict[str, object], section: str, option: str
) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=option):
        load_deepmd_checkpoint(_checkpoint_with(tmp_path, edit, section))


def test_unreadable_checkpoints_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    # The reason names torch's error type ("...: 101" alone said nothing).
    with pytest.raises(UnsupportedCheckpointError, match=r"checkpoint: \w+Error: "):
        load_deepmd_checkpoint(junk)
    empty = tmp_path / "empty.pt"
    torch.save({"model": {"x": torch.zeros(1)}}, empty)
    with pytest.raises(UnsupportedCheckpointError, match="_extra_state"):
        load_deepmd_checkpoint(empty)
    ckpt = torch.load(golden_file("tiny_fused_plain.pt"), weights_only=True)
    ckpt["model"]["model.Default.atomic_model.descriptor.blocks.0.so2_conv.mystery"] = torch.ones(2)
    extra = tmp_path / "extra.pt"
    torch.save(ckpt, extra)
    with pytest.raises(UnsupportedCheckpointError, match="mystery"):
        load_deepmd_checkpoint(extra)


def test_a_failed_save_leaves_no_partial_file(tmp_path: Path) -> None:
    """The file is written beside the target and renamed over it; when the rename fails (the
    target is a folder) neither a half file nor the ``.partial`` copy stays behind."""
    target = tmp_path / "model.safetensors"
    target.mkdir()
    with pytest.raises(OSError):
        save_model(DPA4Model(preset("tiny", ["H", "O"])), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
