"""NVE sanity check of a trained water model: energy drift, O–H distances, energy-vs-time plot.

``python -m service.training.md_check MODEL DATA [--steps N] [--out DIR]`` takes the first frame
of DATA (a DeePMD system or an ASE file), draws Maxwell–Boltzmann velocities at the given
temperature (fixed seed, zero total momentum) and runs ASE's VelocityVerlet at 0.5 fs.

Reported (JSON + PNG): NVE drift in meV/atom/ps (slope of a least-squares line through the total
energy), the largest total-energy excursion, the minimum O–H distance over all pairs, the largest
distance of any H to its nearest O (an H leaving its molecule shows up here), temperature range,
and the largest force. Distances use the minimum-image convention.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from ase import Atoms, units
from ase.calculators.calculator import Calculator
from ase.geometry import get_distances
from ase.md.velocitydistribution import Stationary
from ase.md.verlet import VelocityVerlet

from service.cli_output import cli_fail
from service.training.data import Frame, load_dataset
from service.training.evaluate import can_plot
from service.training.state import folder_problem

__all__ = ["MDReport", "atoms_from_frame", "main", "run_nve"]


@dataclass(frozen=True)
class MDReport:
    n_atoms: int
    steps: int
    timestep_fs: float
    simulated_ps: float
    drift_mev_per_atom_ps: float
    max_excursion_mev_per_atom: float
    min_oh_distance: float
    max_h_to_nearest_o: float
    temperature_min_k: float
    temperature_max_k: float
    temperature_mean_k: float
    max_force: float
    wall_s: float
    ns_per_day: float


def atoms_from_frame(frame: Frame) -> Atoms:
    return Atoms(
        numbers=frame.numbers,
        positions=frame.positions,
        cell=frame.cell if frame.cell is not None else np.zeros((3, 3)),
        pbc=frame.pbc,
    )


def _oh_geometry(atoms: Atoms) -> tuple[float, float]:
    """(minimum O–H distance, largest H-to-nearest-O distance), Å; NaN if O or H is absent."""
    symbols = np.array(atoms.get_chemical_symbols())
    oxygens, hydrogens = atoms.positions[symbols == "O"], atoms.positions[symbols == "H"]
    if len(oxygens) == 0 or len(hydrogens) == 0:
        return math.nan, math.nan
    _, distances = get_distances(hydrogens, oxygens, cell=atoms.cell, pbc=atoms.pbc)
    return float(distances.min()), float(distances.min(axis=1).max())


def run_nve(
    atoms: Atoms,
    calculator: Calculator,
    *,
    steps: int,
    timestep_fs: float = 0.5,
    temperature_k: float = 300.0,
    sample_every: int = 10,
    seed: int = 0,
    max_wall_s: float = 0.0,
) -> tuple[MDReport, dict[str, np.ndarray]]:
    """Run NVE MD; returns the report and the sampled series (time_ps, energies in eV/atom, T).

    ``max_wall_s > 0`` stops early once that much wall time has passed; the report then covers
    the steps actually run.
    """
    atoms = atoms.copy()
    atoms.calc = calculator
    # Maxwell–Boltzmann momenta p = sqrt(m k_B T)·N(0, 1), then zero total momentum.
    masses = atoms.get_masses()[:, None]
    normal = np.random.default_rng(seed).standard_normal((len(atoms), 3))
    atoms.set_momenta(np.sqrt(masses * units.kB * temperature_k) * normal)
    Stationary(atoms)
    n = len(atoms)
    samples: dict[str, list[float]] = {k: [] for k in ("time_ps", "epot", "ekin", "etot", "T")}
    geometry = {"min_oh": math.inf, "max_h_o": 0.0, "max_force": 0.0}

    def sample() -> None:
        epot = atoms.get_potential_energy() / n
        ekin = atoms.get_kinetic_energy() / n
        samples["time_ps"].append(dyn.get_time() / (1000.0 * units.fs))
        samples["epot"].append(epot)
        samples["ekin"].append(ekin)
        samples["etot"].append(epot + ekin)
        samples["T"].append(atoms.get_temperature())
        min_oh, max_h_o = _oh_geometry(atoms)
        geometry["min_oh"] = min(geometry["min_oh"], min_oh)
        geometry["max_h_o"] = max(geometry["max_h_o"], max_h_o)
        force = float(np.linalg.norm(atoms.get_forces(), axis=1).max())
        geometry["max_force"] = max(geometry["max_force"], force)

    dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
    dyn.attach(sample, interval=sample_every)  # ASE also calls it before the first step
    start = time.perf_counter()
    for _ in dyn.irun(steps):
        if max_wall_s > 0.0 and time.perf_counter() - start > max_wall_s:
            break
    wall = time.perf_counter() - start
    steps = dyn.nsteps
    series = {k: np.asarray(v) for k, v in samples.items()}
    etot_mev = 1000.0 * series["etot"]
    slope = float(np.polyfit(series["time_ps"], etot_mev, 1)[0]) if len(etot_mev) > 1 else 0.0
    simulated_ps = steps * timestep_fs / 1000.0
    report = MDReport(
        n_atoms=n,
        steps=steps,
        timestep_fs=timestep_fs,
        simulated_ps=simulated_ps,
        drift_mev_per_atom_ps=slope,
        max_excursion_mev_per_atom=float(np.abs(etot_mev - etot_mev[0]).max()),
        min_oh_distance=geometry["min_oh"],
        max_h_to_nearest_o=geometry["max_h_o"],
        temperature_min_k=float(series["T"].min()),
        temperature_max_k=float(series["T"].max()),
        temperature_mean_k=float(series["T"].mean()),
        max_force=geometry["max_force"],
        wall_s=wall,
        ns_per_day=simulated_ps / 1000.0 / (wall / 86400.0),
    )
    return report, series


def plot_energies(series: dict[str, np.ndarray], report: MDReport, path: Path) -> None:
    """Total energy (with its drift line), potential/kinetic energy and temperature vs time.

    Energies in meV/atom relative to t=0. The total energy gets its own panel: its drift is
    orders of magnitude below the potential/kinetic exchange and would vanish on their scale.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = series["time_ps"]
    relative = {k: 1000.0 * (series[k] - series[k][0]) for k in ("etot", "epot", "ekin")}
    fig, (ax_tot, ax_parts, ax_t) = plt.subplots(
        3, 1, figsize=(7, 8), sharex=True, constrained_layout=True
    )
    ax_tot.plot(t, relative["etot"], lw=1, label="total")
    fit = np.polyfit(t, relative["etot"], 1) if len(t) > 1 else np.zeros(2)
    ax_tot.plot(t, np.polyval(fit, t), lw=1, ls="--", color="0.3", label="linear fit")
    ax_tot.set_ylabel("E_tot − E_tot(0)\n(meV/atom)")
    ax_tot.legend(loc="best")
    ax_tot.set_title(
        f"NVE, {report.n_atoms} atoms, dt {report.timestep_fs} fs, {report.simulated_ps:g} ps: "
        f"drift {report.drift_mev_per_atom_ps:+.3f} meV/atom/ps"
    )
    ax_parts.plot(t, relative["epot"], lw=1, label="potential")
    ax_parts.plot(t, relative["ekin"], lw=1, label="kinetic")
    ax_parts.set_ylabel("E − E(0) (meV/atom)")
    ax_parts.legend(loc="best")
    ax_t.plot(t, series["T"], lw=1, color="C3")
    ax_t.set_ylabel("T (K)")
    ax_t.set_xlabel("time (ps)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _option_problem(
    steps: int, timestep_fs: float, temperature: float, sample_every: int, out: Path
) -> str | None:
    """What is wrong with the options, or None: found before the model loads and the MD runs,
    not when the results are written after it. Creates ``out`` if missing."""
    checks = [
        (steps >= 1, f"--steps must be ≥ 1, got {steps}"),
        (0.0 < timestep_fs < math.inf, f"--timestep-fs must be > 0, got {timestep_fs}"),
        (0.0 <= temperature < math.inf, f"--temperature must be ≥ 0 K, got {temperature}"),
        (sample_every >= 1, f"--sample-every must be ≥ 1, got {sample_every}"),
    ]
    for ok, message in checks:
        if not ok:
            return message
    problem = folder_problem(out)
    return None if problem is None else f"--out: {problem}"


def main(
    model: Annotated[str, typer.Argument(help="Model file, or 'default' for the shipped model.")],
    data: Annotated[
        Path, typer.Argument(help="DeePMD system or ASE file; its first frame is used.")
    ],
    steps: Annotated[int, typer.Option(help="MD steps (20000 = 10 ps at 0.5 fs).")] = 20000,
    timestep_fs: Annotated[float, typer.Option(help="Time step (fs).")] = 0.5,
    temperature: Annotated[float, typer.Option(help="Initial temperature (K).")] = 300.0,
    sample_every: Annotated[int, typer.Option(help="Steps between samples.")] = 10,
    max_wall_s: Annotated[
        float, typer.Option(help="Stop early after this many seconds (0: no limit).")
    ] = 0.0,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    path: Annotated[str, typer.Option(help="auto | fused | reference")] = "auto",
    out: Annotated[Path, typer.Option(help="Output folder for md_check.json / .png")] = Path(
        "runs/md_check"
    ),
) -> None:
    """Run the NVE check and write ``md_check.json`` and ``md_energy.png`` to ``out``."""
    problem = _option_problem(steps, timestep_fs, temperature, sample_every, out)
    if problem is not None:
        raise cli_fail(problem)
    from clients import SO2LocalCalculator

    try:
        frame = load_dataset([data])[0]
        calculator = SO2LocalCalculator(
            model=None if model == "default" else model, device=device, path=path
        )
    except ValueError as exc:  # DataError, ModelFileError, a bad device or path: all ValueErrors
        raise cli_fail(str(exc)) from None
    report, series = run_nve(
        atoms_from_frame(frame),
        calculator,
        steps=steps,
        timestep_fs=timestep_fs,
        temperature_k=temperature,
        sample_every=sample_every,
        max_wall_s=max_wall_s,
    )
    payload = {"model": model, "data": str(data), **asdict(report)}
    (out / "md_check.json").write_text(json.dumps(payload, indent=2) + "\n")
    np.savez(out / "md_series.npz", **series)  # type: ignore[arg-type]
    if can_plot():
        plot_energies(series, report, out / "md_energy.png")
    else:
        typer.echo("md_energy.png not drawn: pip install 'so2serve[plot]' for it", err=True)
    typer.echo(json.dumps(payload, indent=2))


if __name__ == "__main__":
    typer.run(main)
