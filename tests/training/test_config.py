"""Training config loading/overrides and the LR / loss-weight schedules."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from service.training.config import ConfigError, OptimConfig, TrainConfig, load_config
from service.training.schedule import learning_rate, loss_weights

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load() -> None:
    for name in ("water_small.toml", "water_small_cpu.toml"):
        config = load_config(REPO / "configs" / name)
        assert config.data.train and config.model.preset


def test_toml_json_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\ntrain = ["a"]\n[optim]\nlr = 2e-3\n[loss]\nforce_weight = 5\n')
    config = load_config(
        toml, ["run.steps=7", "optim.betas=[0.8, 0.99]", "run.device=cpu", 'data.train=["x","y"]']
    )
    assert config.optim.lr == 2e-3
    assert config.loss.force_weight == [5.0, 5.0]
    assert config.run.steps == 7 and config.run.device == "cpu"
    assert config.optim.betas == [0.8, 0.99]
    assert config.data.train == ["x", "y"]
    as_json = tmp_path / "c.json"
    as_json.write_text(json.dumps(config.to_dict()))
    assert load_config(as_json) == config


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["data.trian=[]"], "data.trian"),
        (["optim.lr=fast"], "optim.lr"),
        (["optim.schedule=linear"], "optim.schedule"),
        (["run.steps=0"], "run.steps"),
        (["loss.energy_weight=[1, 2, 3]"], "loss.energy_weight"),
        (["nokey"], "section.key=value"),
        # A whole section replaced by a scalar: named as typed, not blamed on a later override.
        (["run=3", 'run.output_dir="x"'], "'run=3': expected section.key=value"),
        (["bogus.x=1"], "bogus"),
        (["optim.betas=[1.5, 0.999]"], "optim.betas"),
        (["optim.betas=[0.9, -0.1]"], "optim.betas"),
        # A scalar is [w, w] for a loss weight only: a scalar beta is not silently [b, b].
        (["optim.betas=0.9"], "optim.betas: expected a list"),
        (["optim.eps=0"], "optim.eps"),
        (["optim.weight_decay=-1e-4"], "optim.weight_decay"),
        (['run.device="gpu"'], "run.device"),
        (['run.device="cuda:x"'], "run.device"),
        (["model.overrides.no_such_field=3"], "no_such_field"),
        (['model.overrides.type_map=["H"]'], "data.type_map"),
        (['model.overrides.channels="many"'], "channels"),
        (['model.preset="huge"'], "huge"),
    ],
)
def test_bad_configs(overrides: list[str], fragment: str) -> None:
    """A bad value fails when the config is loaded (before any data), naming the key."""
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, ['data.train=["a"]', *overrides])


def test_missing_train_data() -> None:
    with pytest.raises(ConfigError, match=r"data\.train"):
        TrainConfig.from_dict({})


def test_device_names_are_accepted_without_checking_this_machine() -> None:
    """``cuda:N`` loads anywhere; whether the device exists is checked when training starts."""
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        assert (
            load_config(None, ['data.train=["a"]', f'run.device="{device}"']).run.device == device
        )


def test_warmup_starts_at_a_thousandth_of_the_peak() -> None:
    """The warm-up rises linearly from 0.1 % of the peak LR at progress 0 (default config)."""
    optim = OptimConfig()
    assert learning_rate(0.0, optim) == pytest.approx(1e-3 * optim.lr, rel=1e-9)
    assert learning_rate(optim.warmup_fraction / 2, optim) == pytest.approx(
        (1e-3 + 0.999 / 2) * optim.lr, rel=1e-9
    )


def test_cosine_schedule() -> None:
    optim = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_fraction=0.1, schedule="cosine")
    assert learning_rate(0.0, optim) == pytest.approx(1e-3)
    assert learning_rate(0.05, optim) == pytest.approx(1e-3 + 0.999 * 0.5, rel=1e-6)
    assert learning_rate(0.1, optim) == pytest.approx(1.0)
    assert learning_rate(0.55, optim) == pytest.approx(0.55)
    assert learning_rate(1.0, optim) == pytest.approx(0.1)
    values = [learning_rate(p / 100, optim) for p in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_wsd_schedule_and_weights() -> None:
    optim = OptimConfig(
        lr=1.0, min_lr_ratio=0.0, warmup_fraction=0.0, schedule="wsd", decay_fraction=0.2
    )
    assert learning_rate(0.5, optim) == pytest.approx(1.0)
    assert learning_rate(0.8, optim) == pytest.approx(1.0)
    assert learning_rate(0.9, optim) == pytest.approx(0.5)
    assert learning_rate(1.0, optim) == pytest.approx(0.0)
    config = TrainConfig.from_dict({"data": {"train": ["a"]}})
    assert loss_weights(0.5, optim, config.loss) == pytest.approx((1.0, 100.0, 1.0))
    assert loss_weights(1.0, optim, config.loss) == pytest.approx((10.0, 1.0, 10.0))
    middle = loss_weights(0.9, optim, config.loss)
    assert middle == pytest.approx((5.5, 50.5, 5.5))
