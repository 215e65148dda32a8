"""Packaging and deployment: what a fresh machine gets from the wheel and from the Docker image.

The wheel must carry every file the package code reads at run time (the shipped model, the
launch-tile tables) and must work outside the checkout; the Dockerfile must copy what the wheel
is built from, keep the checkout's local state out of the build context, and give the service
user the directories that compose mounts volumes on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML comes with uvicorn[standard]
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS: dict[str, Any] = PYPROJECT["tool"]["setuptools"]
INCLUDE: list[str] = SETUPTOOLS["packages"]["find"]["include"]
PACKAGE_DATA: dict[str, list[str]] = SETUPTOOLS["package-data"]
TOP_LEVEL = sorted({pattern.rstrip("*").rstrip(".") for pattern in INCLUDE})
"""The top-level package directories: ``so2kernels``, ``service``, ``clients``."""

DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"

WATER = """3
Properties=species:S:1:pos:R:3 pbc="F F F"
O 0.0 0.0 0.0
H 0.96 0.0 0.0
H -0.24 0.93 0.0
"""


def package_files() -> list[Path]:
    """Every file under the top-level package directories, less caches and dot files."""
    return sorted(
        p
        for top in TOP_LEVEL
        for p in (ROOT / top).rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix != ".pyc"
        and not p.name.startswith(".")
    )


def owning_package(file: Path) -> Path:
    """The nearest directory above ``file`` that is a package (holds ``__init__.py``)."""
    folder = file.parent
    while not (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def test_every_module_directory_is_a_discovered_package() -> None:
    """setuptools' ``packages.find`` skips a folder of modules without ``__init__.py``: such a
    folder would be missing from the wheel while every test run from the checkout passes."""
    found = set(find_packages(where=str(ROOT), include=INCLUDE))
    with_modules = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in package_files() if p.suffix == ".py"
    }
    assert with_modules <= found, f"not packaged: {sorted(with_modules - found)}"


def test_every_data_file_of_the_packages_is_package_data() -> None:
    """A non-Python file beside the package code is there to be read at run time (model,
    tables): ``package-data`` must name it, or an installed copy lacks it."""
    unshipped: list[str] = []
    for file in package_files():
        if file.suffix == ".py":
            continue
        package = owning_package(file)
        name = ".".join(package.relative_to(ROOT).parts)
        shipped = {m for pattern in PACKAGE_DATA.get(name, []) for m in package.glob(pattern)}
        if file not in shipped:
            unshipped.append(str(file.relative_to(ROOT)))
    assert not unshipped, f"add to [tool.setuptools.package-data]: {unshipped}"


def run_ok(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command; its stdout, or a failure that shows its output."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} → {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    """Build the wheel from what the Dockerfile copies (pyproject, README, the packages),
    install it into a folder of its own and run the CLI from elsewhere: ``info`` reads the
    shipped model, ``screen`` evaluates a water molecule in process. Nothing may come from
    the checkout (tests/, benchmarks/, configs/ or paths relative to it)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy(ROOT / name, src / name)
    for top in TOP_LEVEL:
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    run_ok([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", "dist", "."], src)
    (wheel,) = (src / "dist").glob("so2serve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "service/models/default.safetensors" in names
    assert "so2kernels/tables/mixing_stack_nvidia_h200.json" in names
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(TOP_LEVEL)

    site = tmp_path / "site"
    run_ok(
        [*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        tmp_path,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "water.extxyz").write_text(WATER)
    # The installed copy first on the path; the checkout (editable install) only behind it.
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = run_ok(
        [sys.executable, "-c", "import clients, service, so2kernels; print(service.__file__)"],
        work,
        env,
    )
    assert Path(where.strip()).is_relative_to(site)
    cli = [sys.executable, str(site / "bin" / "so2serve")]
    assert "serve" in run_ok([*cli, "--help"], work, env)
    assert '"name": "default"' in run_ok([*cli, "info"], work, env)
    run_ok(
        [*cli, "screen", "water.extxyz", "--out", "out", "--no-progress", "--device", "cpu"],
        work,
        env,
    )
    summary = (work / "out" / "summary.csv").read_text().splitlines()
    assert len(summary) == 2 and ",ok," in summary[1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each Dockerfile line, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    rows = [line.strip() for line in text.splitlines()]
    return [
        (row.split(maxsplit=1)[0].upper(), row.split(maxsplit=1)[1])
        for row in rows
        if row and not row.startswith("#")
    ]


def test_the_image_is_built_from_what_the_wheel_needs() -> None:
    """The Dockerfile copies pyproject.toml, its readme and every top-level package (a package
    added later and not copied would be missing from the image only)."""
    copied = {
        part.rstrip("/")
        for op, args in dockerfile_instructions()
        if op == "COPY"
        for part in args.split()[:-1]
    }
    assert {"pyproject.toml", PYPROJECT["project"]["readme"], *TOP_LEVEL} <= copied


def test_the_image_runs_as_a_user_with_its_volume_folders_and_health_check() -> None:
    """Runs unprivileged; each folder compose mounts a named volume on exists in the image,
    made by that user (Docker gives a new named volume the owner of the folder it covers, and
    root if the image lacks it: the Triton cache would not be writable); the health check
    asks /health/ready on the port the service is configured with."""
    env: dict[str, str] = {}
    user = "root"
    made_by_user: set[str] = set()
    health = ""
    for op, args in dockerfile_instructions():
        if op == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", args))
        elif op == "USER":
            user = args.split(":")[0]
        elif op == "RUN" and user not in ("root", "0"):
            expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], m[0]), args)
            for command in re.findall(r"mkdir\s+(?:-p\s+)?([^&;|]+)", expanded):
                made_by_user.update(p.strip("\"'") for p in command.split())
        elif op == "HEALTHCHECK":
            health = args
    assert user not in ("root", "0")
    service = yaml.safe_load(COMPOSE.read_text())["services"]["so2serve"]
    targets = {v.split(":")[1] for v in service.get("volumes", []) if not v.startswith((".", "/"))}
    assert targets <= made_by_user, f"volume folders not made by {user}: {targets - made_by_user}"
    assert "/health/ready" in health and "SO2SERVE_PORT" in health


def ignore_entries(path: Path) -> set[str]:
    """The patterns of an ignore file, without comments and leading or trailing slashes."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line.strip("/") for line in lines if line and not line.startswith("#")}


def test_the_build_context_leaves_out_local_state() -> None:
    """``.dockerignore`` leaves out everything ``.gitignore`` does (the 2 GB .venv, GPU data,
    wheels, snapshots, runs) and the git history: ``docker build`` sends the whole context."""
    missing = ignore_entries(ROOT / ".gitignore") | {".git"}
    missing -= ignore_entries(ROOT / ".dockerignore")
    assert not missing, f"add to .dockerignore: {sorted(missing)}"
