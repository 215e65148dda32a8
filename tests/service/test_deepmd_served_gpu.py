"""Issue 7's GPU proof: DeePMD-kit checkpoints imported with ``so2serve import-deepmd``, served by
``so2serve serve --device cuda`` (fused path), evaluated through ``SO2Calculator`` over HTTP,
give DeePMD's own numbers on every golden system: energies ≤ 1e-5 eV, forces ≤ 1e-5 eV/Å,
virials ≤ 1e-5 eV.

Virials are checked twice: from the calculator's stress (W = −V·σ, ASE's convention, periodic
systems) and as the service's ``virial`` property (every system, the molecule included). Both
wire formats are used. The measured maximum deviations are printed (run with ``-s``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
from ase import Atoms
from ase.stress import voigt_6_to_full_3x3_stress

from clients import SO2Calculator
from clients.http import encode_request, encode_structure, result_arrays
from tests.conftest import shared_path
from tests.service.fakes import REPO, serve_command

pytestmark = pytest.mark.gpu

VARIANTS = ("plain", "s2")
NUMBERS = np.array([8, 1])  # DeePMD type_map [O, H]
ENERGY_TOL, FORCE_TOL, VIRIAL_TOL = 1e-5, 1e-5, 1e-5


def golden_systems(gold: dict[str, np.ndarray]) -> list[tuple[str, Atoms, dict[str, np.ndarray]]]:
    """(name, structure, DeePMD's energy/force/virial/atom_energy) of every golden system."""
    fields = ("energy", "force", "virial", "atom_energy")
    systems = []
    for f in range(len(gold["water_frames"])):
        atoms = Atoms(
            numbers=NUMBERS[gold["water_atype"]],
            positions=gold["water_coord"][f],
            cell=gold["water_box"][f],
            pbc=True,
        )
        systems.append((f"water{f}", atoms, {k: gold[f"water_{k}"][f] for k in fields}))
    cluster = Atoms(numbers=NUMBERS[gold["cluster_atype"]], positions=gold["cluster_coord"])
    systems.append(("cluster", cluster, {k: gold[f"cluster_{k}"] for k in fields}))
    tricl = Atoms(
        numbers=NUMBERS[gold["tricl_atype"]],
        positions=gold["tricl_coord"],
        cell=gold["tricl_box"],
        pbc=True,
    )
    systems.append(("tricl", tricl, {k: gold[f"tricl_{k}"] for k in fields}))
    return systems


def import_checkpoint(checkpoint: Path, output: Path) -> None:
    """``so2serve import-deepmd CHECKPOINT -o OUTPUT``, as a user runs it."""
    command = [sys.executable, "-m", "service.cli", "import-deepmd", str(checkpoint)]
    done = subprocess.run(
        [*command, "-o", str(output)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Both imported checkpoints served at once (two processes), variant → base URL."""
    folder = tmp_path_factory.mktemp("deepmd-served")
    with ExitStack() as stack:
        urls = {}
        for variant in VARIANTS:
            model = folder / f"tiny_fused_{variant}.safetensors"
            import_checkpoint(shared_path("reference", "golden", f"tiny_fused_{variant}.pt"), model)
            log = folder / f"serve_{variant}.log"
            urls[variant] = stack.enter_context(serve_command(model, "cuda", log))
        yield urls


@pytest.mark.parametrize("variant", VARIANTS)
def test_served_deepmd_checkpoint_gives_deepmds_numbers(
    served: dict[str, str], variant: str
) -> None:
    url = served[variant]
    gold = dict(np.load(shared_path("reference", "golden", f"tiny_fused_{variant}_golden.npz")))
    systems = golden_systems(gold)
    worst = {"energy": 0.0, "forces": 0.0, "energies": 0.0, "virial_from_stress": 0.0}
    for wire in ("json", "msgpack"):
        with SO2Calculator(url, wire=wire) as calculator:
            info = calculator.info()
            assert info["execution"]["path"] == "fused", info["execution"]
            assert info["execution"]["device"].startswith("cuda"), info["execution"]
            for name, atoms, ref in systems:
                atoms.calc = calculator
                where = f"{variant}/{wire}/{name}"
                de = abs(atoms.get_potential_energy() - float(ref["energy"]))
                df = float(np.abs(atoms.get_forces() - ref["force"]).max())
                dea = float(np.abs(atoms.get_potential_energies() - ref["atom_energy"]).max())
                assert de <= ENERGY_TOL, (where, de)
                assert df <= FORCE_TOL, (where, df)
                assert dea <= ENERGY_TOL, (where, dea)
                worst["energy"] = max(worst["energy"], de)
                worst["forces"] = max(worst["forces"], df)
                worst["energies"] = max(worst["energies"], dea)
                if atoms.pbc.all():
                    virial = -atoms.get_volume() * voigt_6_to_full_3x3_stress(atoms.get_stress())
                    w = ref["virial"].reshape(3, 3)
                    dv = float(np.abs(virial - 0.5 * (w + w.T)).max())
                    assert dv <= VIRIAL_TOL, (where, dv)
                    worst["virial_from_stress"] = max(worst["virial_from_stress"], dv)
    worst["virial"] = max_virial_deviation(url, systems)
    assert worst["virial"] <= VIRIAL_TOL, (variant, worst["virial"])
    deviations = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    print(f"\n{variant}: max |Δ| from DeePMD over {len(systems)} systems, both wires: {deviations}")


def max_virial_deviation(
    url: str, systems: list[tuple[str, Atoms, dict[str, np.ndarray]]]
) -> float:
    """All systems in one msgpack request for the ``virial`` property (defined for the
    molecule too); the largest |W − W_DeePMD| in eV."""
    body = encode_request(
        [encode_structure(atoms, binary=True) for _, atoms, _ in systems], ("virial",), True
    )
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    response = httpx.post(f"{url}/evaluate", content=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    results = msgpack.unpackb(response.content)["results"]
    return max(
        float(np.abs(result_arrays(r)["virial"].reshape(9) - ref["virial"]).max())
        for r, (_, _, ref) in zip(results, systems, strict=True)
    )
