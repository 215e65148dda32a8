"""A CPU step is refused before it allocates more than the host (or its container) has: past
that point Linux kills the process instead of failing the allocation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms

from service.engine.worker import is_out_of_memory
from service.graph.structures import Structures
from service.model import potential as potential_module
from service.model.config import preset
from service.model.errors import HostMemoryError
from service.model.host_memory import host_available_bytes
from service.model.potential import (
    CPU_EDGE_CHUNK,
    Potential,
    check_host_memory,
    host_edge_capacity,
    host_step_bytes,
)
from tests.model.randomized import randomized_model

GiB = 2**30


def _tree(
    root: Path,
    *,
    meminfo_kb: int | None,
    membership: str | None,
    cgroups: dict[str, dict[str, str]],
) -> tuple[Path, Path]:
    """A fake ``/proc`` and ``/sys/fs/cgroup``: ``cgroups`` maps a folder under the cgroup root
    to its files."""
    proc, cgroup_root = root / "proc", root / "cgroup"
    (proc / "self").mkdir(parents=True)
    cgroup_root.mkdir()
    if meminfo_kb is not None:
        (proc / "meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {meminfo_kb} kB\n"
        )
    if membership is not None:
        (proc / "self" / "cgroup").write_text(membership)
    for folder, files in cgroups.items():
        (cgroup_root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (cgroup_root / folder / name).write_text(text)
    return proc, cgroup_root


def test_meminfo_alone_outside_any_memory_limit(tmp_path: Path) -> None:
    proc, cgroups = _tree(tmp_path, meminfo_kb=8 * 1024**2, membership="0::/\n", cgroups={})
    assert host_available_bytes(proc, cgroups) == 8 * GiB


def test_a_parent_cgroup_v2_limit_binds_and_inactive_cache_counts_as_free(tmp_path: Path) -> None:
    proc, cgroups = _tree(
        tmp_path,
        meminfo_kb=64 * 1024**2,
        membership="0::/pod/server\n",
        cgroups={
            "pod": {
                "memory.max": str(4 * GiB),
                "memory.current": str(3 * GiB),
                "memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
            },
            "pod/server": {"memory.max": "max", "memory.current": "5", "memory.stat": ""},
        },
    )
    assert host_available_bytes(proc, cgroups) == GiB + GiB // 2


def test_cgroup_v1_on_a_hybrid_host(tmp_path: Path) -> None:
    membership = "9:name=systemd:/\n4:memory:/job\n0::/\n"
    limited = {
        "memory/job": {
            "memory.limit_in_bytes": str(2 * GiB),
            "memory.usage_in_bytes": str(GiB),
            "memory.stat": "total_inactive_file 0\n",
        }
    }
    proc, cgroups = _tree(tmp_path / "a", meminfo_kb=64 * 1024**2, membership=membership,
                          cgroups=limited)  # fmt: skip
    assert host_available_bytes(proc, cgroups) == GiB
    no_limit = str(2**63 - 4096)
    unlimited = {"memory/job": {**limited["memory/job"], "memory.limit_in_bytes": no_limit}}
    proc, cgroups = _tree(tmp_path / "b", meminfo_kb=1024**2, membership=membership,
                          cgroups=unlimited)  # fmt: skip
    assert host_available_bytes(proc, cgroups) == GiB  # MemAvailable: the cgroup has no limit


def test_nothing_readable_means_no_figure(tmp_path: Path) -> None:
    proc, cgroups = _tree(tmp_path, meminfo_kb=None, membership=None, cgroups={})
    assert host_available_bytes(proc, cgroups) is None


def test_this_host_reports_a_figure() -> None:
    available = host_available_bytes()
    assert available is None or available > 0


def test_the_estimate_grows_with_edges_and_shrinks_with_chunks() -> None:
    cfg = preset("small", ["H", "O"])
    whole = host_step_bytes(cfg, 100_000, None)
    chunked = host_step_bytes(cfg, 100_000, 2048)
    assert chunked < whole / 3
    assert 1.8 * chunked < host_step_bytes(cfg, 200_000, 2048) < 2 * chunked  # the chunk: once
    assert host_step_bytes(cfg, 1000, 2048) == host_step_bytes(cfg, 1000, None)


def test_check_refuses_only_above_the_available_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset("small", ["H", "O"])
    needed = host_step_bytes(cfg, 50_000, 2048)
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: needed)
    check_host_memory(cfg, 50_000, 2048)
    with pytest.raises(HostMemoryError, match=r"50,001 edges on the CPU needs about .* GiB"):
        check_host_memory(cfg, 50_001, 2048)
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: None)
    check_host_memory(cfg, 10**9, None)  # no figure to compare with: no refusal


def test_the_edge_capacity_inverts_the_estimate() -> None:
    cfg = preset("small", ["H", "O"])
    for available in (GiB, 20 * GiB):
        capacity = host_edge_capacity(cfg, available)
        assert capacity > CPU_EDGE_CHUNK
        assert host_step_bytes(cfg, capacity, CPU_EDGE_CHUNK) <= available
        assert host_step_bytes(cfg, capacity + 10, CPU_EDGE_CHUNK) > available
    assert host_edge_capacity(cfg, 1024) == 0
    # float64 steps (validation, finite differences) take twice the bytes
    assert host_edge_capacity(cfg, 20 * GiB, torch.float64) == host_edge_capacity(cfg, 10 * GiB)
    assert host_step_bytes(cfg, 10**5, None, torch.float64) == 2 * host_step_bytes(cfg, 10**5, None)


def test_a_cpu_potential_reports_its_pass_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset("tiny", ["O", "H"], channels=32, n_focus=2, focus_dim=32)
    pot = Potential(randomized_model(cfg, seed=1), device="cpu", path="reference")
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: 8 * GiB)
    assert pot.pass_edge_capacity() == host_edge_capacity(cfg, 4 * GiB)
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: None)
    assert pot.pass_edge_capacity() is None


def test_a_cpu_potential_refuses_a_step_the_host_cannot_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = preset("tiny", ["O", "H"], channels=32, n_focus=2, focus_dim=32)
    pot = Potential(randomized_model(cfg, seed=1), device="cpu", path="reference")
    rng = np.random.default_rng(0)
    atoms = Atoms("OH2" * 4, positions=rng.uniform(0, 6, (12, 3)), cell=np.eye(3) * 6, pbc=True)
    structures = Structures.from_atoms([atoms])
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: 1024)
    with pytest.raises(HostMemoryError, match="on the CPU needs about"):
        pot.predict(structures, ("energy", "forces"))
    monkeypatch.setattr(potential_module, "host_available_bytes", lambda: 64 * GiB)
    assert torch.isfinite(pot.predict(structures, ("energy", "forces")).forces).all()


def test_allocation_failures_on_the_cpu_count_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as failed:
        torch.empty(2**62, dtype=torch.uint8)  # this torch's own wording of a refused malloc
    assert is_out_of_memory(failed.value)
    assert is_out_of_memory(HostMemoryError("needs 9 GiB"))
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
