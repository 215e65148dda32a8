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
        (["bogus.x=1"], "bogus"),
    ],
)
def test_bad_configs(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(None, ['data.train=["a"]', *overrides])


def test_missing_train_data() -> None:
    with pytest.raises(ConfigError, match=r"data\.train"):
        TrainConfig.from_dict({})


def test_cosine_schedule() -> None:
    optim = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_fraction=0.1, schedule="cosine")
    assert learning_rate(0.0, optim) < 0.02
    assert learning_rate(0.05, optim) == pytest.approx(0.51 / 1.01 * 1.0, rel=1e-6)
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
