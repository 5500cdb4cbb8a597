"""The loader between a prefill engine on a 4-device mesh and a decode engine: `mesh_cases.py`
in a process with 4 CPU devices (the rest of the suite runs on one)."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
def test_loader_between_a_mesh_and_one_device(run_on_cpu_devices):
    run_on_cpu_devices(HERE / "mesh_cases.py", 4)
