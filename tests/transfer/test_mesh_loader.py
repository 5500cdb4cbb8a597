"""The loader between a prefill engine on a 4-device mesh and a decode engine: `mesh_cases.py`
in a process with 4 CPU devices (the rest of the suite runs on one)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
def test_loader_between_a_mesh_and_one_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "mesh_cases.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=HERE.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
