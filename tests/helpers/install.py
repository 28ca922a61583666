"""Projects pip-installed into a folder of their own (``pip install --target``), for subprocesses
that get it on ``PYTHONPATH``: the shared environment is never changed, and entry points are
found through the installed ``.dist-info``."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The fixture projects (``tests/fixtures/<name>``: a broken plugin, a torchrun-only plugin).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
#: Seconds one ``pip install`` may take (a loaded 2-core machine builds a wheel slowly).
PIP_TIMEOUT_S = 240


def pip_install_target(site: Path, *projects: Path) -> Path:
    """pip-install the project folders ``projects`` into ``site`` (``--target``: no index, no
    dependencies, no build isolation) and return ``site``. The build writes ``build/`` and
    ``*.egg-info`` into a project folder: give it a copy."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            *map(str, projects),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
    )
    return site


@contextlib.contextmanager
def installed_fixtures(*names: str) -> Iterator[Path]:
    """The fixture projects ``names`` pip-installed into ``site/`` of a new temporary directory,
    which is removed at the end (also when the install fails). Each project is copied first, so the
    build leaves nothing in the tree."""
    target = Path(tempfile.mkdtemp(prefix="fsm_agent_fixture_dists_"))
    try:
        sources = [target / "src" / name for name in names]
        for name, source in zip(names, sources):
            shutil.copytree(FIXTURES / name, source)
        site = pip_install_target(target / "site", *sources)
        shutil.rmtree(target / "src")
        yield site
    finally:
        shutil.rmtree(target, ignore_errors=True)
