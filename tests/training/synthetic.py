"""Tiny synthetic training data built in ``tmp_path``: water molecules or a periodic water box.

Nothing here needs the shared data sets; a test run on these takes seconds on CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WATER = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])  # O, H, H (Å)


def write_water_system(
    folder: Path,
    n_frames: int,
    *,
    molecules: int = 1,
    periodic: bool = False,
    type_map: bool = True,
    seed: int = 0,
) -> Path:
    """A DeePMD npy system (one ``set.000``) of ``molecules`` water molecules, random labels.

    Types are ``O H H`` per molecule with ``type_map.raw`` = ``O H`` (omitted when ``type_map``
    is false); periodic systems sit in a 10 Å cubic box, others carry the ``nopbc`` marker.
    """
    rng = np.random.default_rng(seed)
    (folder / "set.000").mkdir(parents=True)
    types = np.tile([0, 1, 1], molecules)
    np.savetxt(folder / "type.raw", types, fmt="%d")
    if type_map:
        (folder / "type_map.raw").write_text("O\nH\n")
    if not periodic:
        (folder / "nopbc").write_text("")
    offsets = np.array([[3.0 * m, 0.0, 0.0] for m in range(molecules)])
    base = (WATER[None, :, :] + offsets[:, None, :]).reshape(-1, 3) + 2.0
    coords = base[None] + 0.05 * rng.standard_normal((n_frames, *base.shape))
    n_atoms = base.shape[0]
    np.save(folder / "set.000" / "coord.npy", coords.reshape(n_frames, -1))
    np.save(folder / "set.000" / "energy.npy", -14.0 * molecules + rng.standard_normal(n_frames))
    np.save(folder / "set.000" / "force.npy", rng.standard_normal((n_frames, 3 * n_atoms)))
    if periodic:
        np.save(folder / "set.000" / "box.npy", np.tile(10.0 * np.eye(3).ravel(), (n_frames, 1)))
    return folder


def truncate_sets(system: Path, n_frames: int) -> None:
    """Keep only the first ``n_frames`` frames of every array of ``system/set.000``."""
    for npy in (system / "set.000").iterdir():
        np.save(npy, np.load(npy)[:n_frames])


def tiny_run_overrides(system: Path, output_dir: Path, *extra: str) -> list[str]:
    """``--set`` overrides for a seconds-long CPU run of the tiny preset on ``system``."""
    return [
        f"data.train=['{system}']",
        "data.valid_fraction=0.25",
        "model.preset='tiny'",
        "run.device='cpu'",
        "run.path='reference'",
        "run.progress=false",
        f"run.output_dir='{output_dir}'",
        *extra,
    ]


def tiny_run_config_file(tmp_path: Path, system: Path) -> Path:
    """A TOML config file for a 2-step tiny run on ``system``, output in ``tmp_path/run``."""
    lines = [
        "[data]",
        f'train = ["{system}"]',
        "valid_fraction = 0.25",
        "[model]",
        'preset = "tiny"',
        "[run]",
        "steps = 2",
        f'output_dir = "{tmp_path / "run"}"',
        'device = "cpu"',
        'path = "reference"',
        "progress = false",
    ]
    config = tmp_path / "train.toml"
    config.write_text("\n".join(lines) + "\n")
    return config
