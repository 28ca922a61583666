"""What the checkpoint tests share: a folder in /dev/shm for their slots."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def shm(request):
    """A fresh folder in /dev/shm for the test's slots, removed at teardown."""
    path = tempfile.mkdtemp(dir="/dev/shm", prefix="fsm_agent_test_")
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    return path
