"""An engine's model on its mesh: `mesh_cases.py` in a process with 4 CPU devices (the rest of
the suite runs on one)."""

from __future__ import annotations

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
def test_engine_model_on_a_mesh(run_on_cpu_devices):
    run_on_cpu_devices(HERE / "mesh_cases.py", 4)
