"""How much memory a CPU step may still take: the host's available memory, capped by the
memory limit of the process's control group (a container's ``--memory``).

An allocation past it is not refused on Linux: the kernel over-commits, and its out-of-memory
killer then ends the whole server. So a CPU step compares its estimate with this figure first
(:func:`service.model.potential.check_host_memory`) and is refused like a device step that does
not fit.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def host_available_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process may still allocate: ``MemAvailable``, capped by its control group's
    headroom (cgroup v2 or v1); ``None`` where neither can be read (not Linux)."""
    figures = [
        figure
        for figure in (_meminfo_available(proc), _cgroup_headroom(proc, cgroup_root))
        if figure is not None
    ]
    return min(figures) if figures else None


def _meminfo_available(proc: Path) -> int | None:
    try:
        lines = (proc / "meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # reported in kB
    return None


def _cgroup_headroom(proc: Path, cgroup_root: Path) -> int | None:
    """The least headroom (limit minus usage) of the process's memory cgroup and its ancestors
    (a parent's limit binds its children too); None where none has a limit."""
    try:
        membership = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    headrooms: list[int] = []
    for line in membership:  # hybrid hosts list v1 controllers and the v2 hierarchy together
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            root, files = cgroup_root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            root = cgroup_root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        leaf = root / path.lstrip("/")
        folders = [leaf, *(parent for parent in leaf.parents if parent.is_relative_to(root))]
        headrooms += [h for h in (_headroom(folder, *files) for folder in folders) if h is not None]
    return min(headrooms) if headrooms else None


UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2^63 (rounded down to the page size)."""


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text())
        stat = (folder / "memory.stat").read_text().splitlines()
    except (OSError, ValueError):
        return None  # no limit at this level, or a folder the container hides
    if limit_text == "max" or int(limit_text) >= UNLIMITED_V1:
        return None
    inactive = 0
    for line in stat:
        key, _, value = line.partition(" ")
        if key == inactive_key:
            inactive = int(value)
    return max(int(limit_text) - usage + inactive, 0)
