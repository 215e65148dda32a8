"""A tiny training run lowers the loss, and a resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.model.io import load_model, read_metadata
from service.model.potential import Potential, default_model_path, load_potential
from service.training import loop
from service.training.cli import train_command
from service.training.config import DataConfig, TrainConfig, load_config
from service.training.data import DataError, collate, load_dataset, load_deepmd_system
from service.training.evaluate import evaluate_frames
from service.training.loop import (
    Trainer,
    build_model,
    choose_training_path,
    fit_energy_reference,
    initialize_energy_bias,
    prepare_data,
    train,
    validation_loss,
)
from service.training.schedule import learning_rate, loss_weights
from service.training.state import load_checkpoint
from tests.conftest import shared_path
from tests.training.synthetic import tiny_run_overrides, write_water_system

MOLECULES = "data/combustion-nopbc/C4H3O1"  # 15 frames of 8 atoms: fast on CPU


def _config(output_dir: Path, optim: dict[str, Any] | None = None, **run: Any) -> TrainConfig:
    shared_root = shared_path("data").parent
    raw = {
        "data": {
            "roots": [str(shared_root)],
            "train": [MOLECULES],
            "valid_fraction": 0.2,
            "batch_size": 4,
            "valid_batch_size": 8,
        },
        "model": {"preset": "tiny", "overrides": {"n_blocks": 1, "n_radial": 4}},
        "optim": {
            "lr": 3e-3,
            "schedule": "constant",
            "warmup_fraction": 0.0,
            "ema_decay": 0.0,
            **(optim or {}),
        },
        "loss": {"energy_weight": 1.0, "force_weight": 1.0},
        "run": {
            "steps": 9,
            "eval_every": 3,
            "checkpoint_every": 3,
            "output_dir": str(output_dir),
            "device": "cpu",
            "path": "reference",
            "progress": False,
            "export": "final",
            **run,
        },
    }
    return TrainConfig.from_dict(raw)


def _train_loss(model: torch.nn.Module, config: TrainConfig) -> float:
    data = prepare_data(config.data)
    potential = Potential(model, device="cpu", path="reference")
    result = evaluate_frames(potential, data.train, batch_size=8)
    return validation_loss(result.errors, (1.0, 1.0, 0.0))


def test_energy_reference_least_squares() -> None:
    dataset = load_dataset([shared_path("data", "combustion-nopbc")])
    reference = fit_energy_reference(dataset, ["H", "C", "O"])
    counts = np.array([[np.sum(f.numbers == z) for z in (1, 6, 8)] for f in dataset])
    energies = np.array([f.energy for f in dataset])
    residual = counts @ reference - energies
    # normal equations hold: the residual is orthogonal to the composition columns
    np.testing.assert_allclose(counts.T @ residual, 0.0, atol=1e-6 * np.abs(energies).sum())


def test_initial_bias_centres_the_untrained_model(tmp_path: Path) -> None:
    config = _config(tmp_path / "run")
    data = prepare_data(config.data)  # one composition: every frame is C4H3O1
    model = build_model(config, data.type_map)
    initialize_energy_bias(
        model, data.train, data.type_map, device=torch.device("cpu"), path="reference"
    )
    potential = Potential(model, device="cpu", path="reference")
    errors = []
    for frame in data.train:
        structures = collate([frame]).structures
        errors.append(float(potential.predict(structures, ("energy",)).energy[0]) - frame.energy)
    # the net's output is centred per element, and the least-squares residuals sum to zero
    assert abs(np.mean(errors)) < 1e-3


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    config = _config(tmp_path / "run", steps=12)
    data = prepare_data(config.data)
    initial = build_model(config, data.type_map)
    initialize_energy_bias(
        initial, data.train, data.type_map, device=torch.device("cpu"), path="reference"
    )
    before = _train_loss(initial, config)
    result = train(config)
    after = _train_loss(load_model(result.model_path), config)
    assert result.steps == 12 and result.exported_step == 12
    assert after < 0.8 * before, (before, after)
    rows = list(csv.DictReader(result.log_csv.open()))
    assert [int(r["step"]) for r in rows] == [3, 6, 9, 12]
    assert all(float(r["val_forces_rmse"]) > 0 for r in rows)
    assert result.execution["path"] == "reference"


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a nested checkpoint into {path: tensor} (numbers become 0-d tensors)."""
    flat: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for key, value in state.items():
            flat.update(_tensors(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            flat.update(_tensors(value, f"{prefix}/{i}"))
    elif isinstance(state, torch.Tensor):
        flat[prefix] = state
    elif isinstance(state, (int, float)):
        flat[prefix] = torch.tensor(state)
    return flat


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    # EMA, warm-up + cosine and best-model tracking all take part
    optim = {"ema_decay": 0.9, "schedule": "cosine", "warmup_fraction": 0.2}
    common: dict[str, Any] = {"steps": 6, "eval_every": 2, "checkpoint_every": 2, "export": "best"}
    straight = train(_config(tmp_path / "a", optim, **common))
    config_b = _config(tmp_path / "b", optim, session_steps=3, **common)
    interrupted = train(config_b)
    assert interrupted.steps == 3
    config_path = tmp_path / "b.json"
    config_path.write_text(json.dumps(config_b.to_dict()))
    resumed = train_command(config_path, ["run.session_steps=0"], resume=True)
    assert resumed.steps == 6

    state_a = load_checkpoint(straight.checkpoint_path)
    state_b = load_checkpoint(resumed.checkpoint_path)
    skip = ("/elapsed_s", "/rng/cuda")
    tensors_a = {k: v for k, v in _tensors(state_a).items() if not k.startswith(skip)}
    tensors_b = {k: v for k, v in _tensors(state_b).items() if not k.startswith(skip)}
    assert tensors_a.keys() == tensors_b.keys()
    for key, value in tensors_a.items():
        torch.testing.assert_close(value, tensors_b[key], rtol=0, atol=0, equal_nan=True, msg=key)
    for name, value in load_model(straight.model_path).state_dict().items():
        assert torch.equal(value, load_model(resumed.model_path).state_dict()[name]), name

    def rows(path: Path) -> list[dict[str, str]]:
        return [
            {k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(path.open())
        ]

    assert rows(straight.log_csv) == rows(resumed.log_csv)


def test_resume_refuses_a_changed_model(tmp_path: Path) -> None:
    train(_config(tmp_path / "run", steps=2, checkpoint_every=1))
    changed = _config(tmp_path / "run", steps=4, resume=True)
    changed.model.overrides["n_radial"] = 6
    with pytest.raises(ValueError, match=r"model\.overrides"):
        train(changed)


def test_shipped_config_resolves_data() -> None:
    repo = Path(__file__).resolve().parents[2]
    config = load_config(repo / "configs" / "water_small.toml")
    shared_path("data", "water")
    import os

    cwd = Path.cwd()
    try:
        os.chdir(repo)
        data = prepare_data(config.data)
    finally:
        os.chdir(cwd)
    assert len(data.train) == 288 and len(data.validation) == 32
    assert data.type_map == ["H", "O"]


def test_wall_clock_budget_ends_the_run(tmp_path: Path) -> None:
    result = train(_config(tmp_path / "run", steps=1000, max_time_s=1e-6))
    assert result.steps == 1
    rows = list(csv.DictReader(result.log_csv.open()))
    assert [int(r["step"]) for r in rows] == [1]


def test_logged_schedule_is_that_of_the_logged_step(tmp_path: Path) -> None:
    """log.csv's ``lr`` and ``w_*`` at row ``step = k`` are the values step k ran with
    (progress (k−1)/steps), not those of the next step."""
    system = write_water_system(tmp_path / "sys", 4)
    overrides = tiny_run_overrides(
        system, tmp_path / "run", "run.steps=2", "run.eval_every=1", "optim.warmup_fraction=0.0"
    )
    config = load_config(None, overrides)
    result = train(config)
    rows = list(csv.DictReader(result.log_csv.open()))
    assert [int(row["step"]) for row in rows] == [1, 2]
    progress = [0.0, 0.5]
    expected_lr = [learning_rate(p, config.optim) for p in progress]
    assert [float(row["lr"]) for row in rows] == pytest.approx(expected_lr, rel=1e-6)
    for row, p in zip(rows, progress, strict=True):
        weights = (float(row["w_energy"]), float(row["w_forces"]), float(row["w_virial"]))
        assert weights == pytest.approx(loss_weights(p, config.optim, config.loss), rel=1e-6)


def test_a_session_stopped_early_leaves_export_path_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``run.export_path`` may be a model others load (the shipped default's config points
    there): a session stopped by ``run.session_steps`` writes its snapshot into the run folder,
    and only the finished run exports. Resuming without a checkpoint says so."""
    system = write_water_system(tmp_path / "sys", 4)
    export = tmp_path / "shipped" / "model.safetensors"
    settings = ("run.steps=2", f"run.export_path='{export}'")
    caplog.set_level("WARNING", logger="so2serve.training")
    session = ("run.session_steps=1", "run.resume=true")
    first = train(load_config(None, tiny_run_overrides(
        system, tmp_path / "run", *settings, *session)))  # fmt: skip
    assert "no checkpoint" in caplog.text
    assert not first.finished and first.steps == 1
    assert first.model_path == tmp_path / "run" / "model.safetensors" and not export.exists()
    done = train(load_config(None, tiny_run_overrides(
        system, tmp_path / "run", *settings, "run.resume=true")))  # fmt: skip
    assert done.finished and done.steps == 2 and done.model_path == export and export.is_file()


def test_resume_from_a_moved_run_folder(tmp_path: Path) -> None:
    """A run folder copied elsewhere resumes there; run.output_dir, run.device and run.path may
    differ from the checkpoint's (they do not change what is learned)."""
    system = write_water_system(tmp_path / "sys", 4)
    first = tiny_run_overrides(system, tmp_path / "a", "run.steps=2", "run.session_steps=1")
    train(load_config(None, first))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = tiny_run_overrides(
        system, tmp_path / "b", "run.steps=2", "run.resume=true", "run.path='auto'"
    )
    result = train(load_config(None, resumed))
    assert result.steps == 2 and result.output_dir == tmp_path / "b"
    assert load_checkpoint(tmp_path / "a" / "checkpoint.pt")["step"] == 1  # the original is kept


def _shifted_labels_system(tmp_path: Path) -> Path:
    """(H₂O)₃ frames labelled with the default model's own forces and energies shifted by
    O −2 eV, H +0.5 eV (another DFT setup's references): −1 eV per molecule, −1/3 eV/atom."""
    system = write_water_system(tmp_path / "sys", 6, molecules=3, periodic=True)
    potential = load_potential(None, device="cpu")
    prediction = potential.predict(collate(load_deepmd_system(system)).structures)
    assert prediction.forces is not None
    per_molecule_shift = -2.0 + 2 * 0.5
    np.save(system / "set.000" / "energy.npy", prediction.energy.numpy() + 3 * per_molecule_shift)
    np.save(system / "set.000" / "force.npy", prediction.forces.numpy().reshape(6, -1))
    return system


def _fine_tune_overrides(system: Path, output_dir: Path, *extra: str) -> list[str]:
    return tiny_run_overrides(
        system,
        output_dir,
        f"model.init_from='{default_model_path()}'",
        "data.valid_fraction=0.34",
        "optim.lr=1e-9",  # the weights barely move: what remains is the bias
        *extra,
    )


def _bias_by_symbol(model: torch.nn.Module, type_map: Sequence[str]) -> dict[str, float]:
    return dict(zip(type_map, model.get_buffer("energy_bias").tolist(), strict=True))


def test_fine_tuning_refits_the_energy_reference(tmp_path: Path) -> None:
    """Fine-tuning adds the per-element least-squares fit of (labels − loaded model) to the
    loaded energy bias before the first step, so a per-element reference shift is not error."""
    system = _shifted_labels_system(tmp_path)
    result = train(load_config(None, _fine_tune_overrides(system, tmp_path / "run", "run.steps=1")))
    assert result.validation["energy_rmse"] < 0.01  # eV/atom; 1/3 without the refit
    loaded = load_model(default_model_path())
    tuned = load_model(result.model_path)
    before = _bias_by_symbol(loaded, loaded.config.type_map)
    after = _bias_by_symbol(tuned, tuned.config.type_map)
    # One composition: only the per-molecule sum of the correction is determined.
    per_molecule = (after["O"] - before["O"]) + 2 * (after["H"] - before["H"])
    assert per_molecule == pytest.approx(-1.0, abs=1e-4)


def test_fine_tuning_can_keep_the_loaded_energy_reference(tmp_path: Path) -> None:
    """``model.refit_energy_reference=false`` keeps the loaded bias: the shift stays as error."""
    system = _shifted_labels_system(tmp_path)
    overrides = _fine_tune_overrides(
        system, tmp_path / "run", "run.steps=1", "model.refit_energy_reference=false"
    )
    result = train(load_config(None, overrides))
    assert result.validation["energy_rmse"] == pytest.approx(1 / 3, abs=0.01)
    loaded, tuned = load_model(default_model_path()), load_model(result.model_path)
    assert torch.equal(loaded.get_buffer("energy_bias"), tuned.get_buffer("energy_bias"))
    # The parent is recorded by identity, not only by a path whose file may be replaced.
    parent = read_metadata(result.model_path)["provenance"]["init_from"]
    assert parent["model_sha256"] == read_metadata(default_model_path())["model_sha256"]


def test_resumed_fine_tuning_does_not_refit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On resume the bias comes from the checkpoint; no refit is computed again."""
    system = _shifted_labels_system(tmp_path)
    run = tmp_path / "run"
    train(
        load_config(None, _fine_tune_overrides(system, run, "run.steps=2", "run.session_steps=1"))
    )

    def refit_called(*args: object, **kwargs: object) -> dict[str, float]:
        raise AssertionError("refit_energy_reference was called on resume")

    monkeypatch.setattr(loop, "refit_energy_reference", refit_called)
    resumed = train(load_config(None, _fine_tune_overrides(system, run, "run.steps=2",
                                                           "run.resume=true")))  # fmt: skip
    assert resumed.steps == 2


def test_refit_sample_holds_every_source() -> None:
    """The fine-tuning refit samples ~256 frames evenly over the data, plus the first frame of
    each source the spacing steps over: a small source (and an element only it has) is never
    left out of the fit."""
    from service.training.data import Frame, FrameDataset

    def frame(source: str, numbers: list[int]) -> Frame:
        n = len(numbers)
        positions = np.arange(3 * n, dtype=np.float64).reshape(n, 3)
        return Frame(np.array(numbers), positions, None, np.zeros(3, bool), 0.0, None, None, source)

    frames = FrameDataset(
        [frame("big", [8, 1, 1]) for _ in range(1000)]
        + [frame("small", [6, 1, 1, 1, 1]) for _ in range(2)]
        + [frame("big2", [8, 1, 1]) for _ in range(1000)]
    )
    sample = loop._spread_sample(frames, 10)
    assert {f.source for f in sample} == {"big", "small", "big2"}
    assert len(sample) <= 10 + 3 and "C" in sample.elements


def test_refit_sample_holds_every_element_of_a_mixed_source() -> None:
    """A mixed-type source changes composition from frame to frame: an element found in one
    frame only (here C in frame 500 of 1,000) is still in the refit's sample."""
    from service.training.data import Frame, FrameDataset

    def frame(numbers: list[int]) -> Frame:
        n = len(numbers)
        positions = np.arange(3 * n, dtype=np.float64).reshape(n, 3)
        return Frame(np.array(numbers), positions, None, np.zeros(3, bool), 0.0, None, None, "m")

    frames = FrameDataset([frame([6, 1, 1, 1, 1] if k == 500 else [8, 1, 1]) for k in range(1000)])
    sample = loop._spread_sample(frames, 256)
    assert set(sample.elements) == {"C", "H", "O"}
    assert len(sample) <= 256 + 1


def test_initial_bias_is_the_float64_least_squares_fit(tmp_path: Path) -> None:
    """With no frames sampled for the network's offset, the bias is the least-squares reference
    itself, to the last float64 bit (it went through a float32 tensor)."""
    system = write_water_system(tmp_path / "sys", 4)
    config = load_config(None, tiny_run_overrides(system, tmp_path / "run"))
    data = prepare_data(config.data)
    model = build_model(config, data.type_map)
    cpu = torch.device("cpu")
    bias = initialize_energy_bias(
        model, data.train, data.type_map, device=cpu, path="reference", sample_frames=0
    )
    reference = fit_energy_reference(data.train, data.type_map)
    assert [bias[s] for s in data.type_map] == reference.tolist()


def test_explicit_validation_sharing_a_training_system_is_refused(tmp_path: Path) -> None:
    """``data.validation`` naming a system that ``data.train`` holds (here through its folder)
    would validate on trained frames."""
    folder = tmp_path / "data"
    write_water_system(folder / "a", 2)
    write_water_system(folder / "b", 2, seed=1)
    config = DataConfig(train=[str(folder)], validation=[str(folder / "b")])
    with pytest.raises(DataError, match=r"data\.train and data\.validation") as info:
        prepare_data(config)
    assert info.value.path == str(folder / "b")


def _read_resume_event(log_jsonl: Path) -> dict[str, Any]:
    events: list[dict[str, Any]] = [json.loads(line) for line in log_jsonl.read_text().splitlines()]
    (resume,) = [event for event in events if event.get("event") == "resume"]
    return resume


def test_resume_may_lower_the_lr_clip_and_batch_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The advice after a diverged run (lower optim.lr, set optim.clip_norm) or a run out of
    memory (lower data.batch_size) can be followed: the resume takes the new settings, says
    what changed, and the optimizer steps with the new LR, not the checkpointed one."""
    system = write_water_system(tmp_path / "sys", 4)
    run = tmp_path / "run"
    constant_lr = ("optim.schedule='constant'", "optim.warmup_fraction=0")
    common = ("run.steps=4", "run.eval_every=1", *constant_lr)
    first = (*common, "optim.lr=1e-3", "data.batch_size=2", "run.session_steps=2")
    train(load_config(None, tiny_run_overrides(system, run, *first)))
    caplog.set_level("WARNING", logger="so2serve.training")
    retuned = ("optim.lr=2e-4", "optim.clip_norm=1.0", "data.batch_size=1", "run.resume=true")
    resumed = train(load_config(None, tiny_run_overrides(system, run, *common, *retuned)))
    assert resumed.steps == 4
    rows = list(csv.DictReader(resumed.log_csv.open()))
    assert [float(row["lr"]) for row in rows] == pytest.approx([1e-3, 1e-3, 2e-4, 2e-4])
    optimizer = load_checkpoint(resumed.checkpoint_path)["optimizer"]
    assert [group["lr"] for group in optimizer["param_groups"]] == [2e-4]
    changes = ("optim.lr 0.001 → 0.0002", "optim.clip_norm 10.0 → 1.0", "data.batch_size 2 → 1")
    assert all(change in caplog.text for change in changes), caplog.text
    event = _read_resume_event(resumed.log_jsonl)
    assert event["retuned"]["optim.lr"] == [1e-3, 2e-4]
    assert event["lr"] == {"checkpointed": 1e-3, "now": 2e-4}


def test_resume_with_more_steps_reports_the_lr_it_moves_to(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The schedules are functions of step / run.steps: extending a run moves it back along the
    cosine, which the resume reports with the LR before and after."""
    system = write_water_system(tmp_path / "sys", 4)
    run = tmp_path / "run"
    first = load_config(None, tiny_run_overrides(system, run, "run.steps=4", "run.session_steps=2"))
    train(first)
    caplog.set_level("WARNING", logger="so2serve.training")
    longer = ("run.steps=8", "run.session_steps=1", "run.resume=true")
    train(load_config(None, tiny_run_overrides(system, run, *longer)))
    before, after = learning_rate(2 / 4, first.optim), learning_rate(2 / 8, first.optim)
    assert after > before
    assert f"run.steps 4 → 8: the next step's LR is {after:.4g} ({before:.4g} with" in caplog.text
    assert "step / run.steps" in caplog.text


def test_fused_path_check_falls_back_on_a_triton_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton's compile and resource errors are not RuntimeErrors; the second-order check still
    falls back to the reference path on them, as it promises."""
    from triton.runtime.errors import OutOfResources

    system = write_water_system(tmp_path / "sys", 4)
    config = load_config(None, tiny_run_overrides(system, tmp_path / "run", "run.path='fused'"))
    data = prepare_data(config.data)
    trainer = Trainer(config, data, build_model(config, data.type_map))
    assert trainer.potential.execution.path == "fused"

    def gradients(potential: Potential, *args: object) -> tuple[torch.Tensor, float]:
        if potential.execution.path == "fused":
            raise OutOfResources(98304, 65536, "shared memory")
        return torch.ones(3), 0.01

    monkeypatch.setattr(loop, "force_loss_gradients", gradients)
    assert choose_training_path(trainer) == "reference"
    assert trainer.potential.execution.path == "reference"
