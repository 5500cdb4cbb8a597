"""colab/: every notebook source `colab/*.py` (jupytext percent format) has an `.ipynb` twin with
the same cells, and runs top to bottom on CPU in a Jupyter kernel of this interpreter.

Regenerate the twins after editing a source with `make notebooks`.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import runpy
import subprocess
import sys
import time

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.py"))
INSTALLER = ROOT / "colab" / "setup" / "install.py"  # what every install cell runs
CELL_TIMEOUT_S = 600


def cells(path: pathlib.Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell; outputs and metadata do not matter."""
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


def starts_engines(path: pathlib.Path) -> bool:
    text = path.read_text()
    return "LocalCluster" in text or "RayCluster" in text


def needs_ray(path: pathlib.Path) -> bool:
    """The notebook runs on Ray (the `ray` extra, which the full tier installs)."""
    return "\nimport ray\n" in path.read_text()


def run_marks(path: pathlib.Path) -> list:
    marks = [pytest.mark.multiprocess] if starts_engines(path) else []
    if needs_ray(path):
        no_ray = importlib.util.find_spec("ray") is None
        marks.append(pytest.mark.skipif(no_ray, reason="needs the ray extra"))
    return marks


def engine_pids(marker: str) -> list[int]:
    """PIDs of live processes whose command line mentions `marker` (a run's own directory)."""
    out = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(proc.name))
    return out


def test_there_are_notebooks():
    names = {p.stem for p in NOTEBOOKS}
    assert {"01_quickstart", "02_layerwise_and_dual_path", "03_simulator"} <= names


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_ipynb_twin_matches_source(source):
    twin = source.with_suffix(".ipynb")
    assert twin.is_file(), f"{twin.name} is missing: run `make notebooks`"
    assert cells(twin) == cells(source), (
        f"{twin.name} differs from {source.name}: run `make notebooks`"
    )


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_says_what_and_how_to_install(source):
    kind, text = cells(source)[0]
    assert kind == "markdown" and text.startswith("# "), "start with a markdown title cell"
    assert "pip install -e ." in text, "say how to install: `pip install -e .` from a clone"


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_install_cell_runs_the_shared_installer(source):
    code = next(text for kind, text in cells(source) if kind == "code")
    run = f'runpy.run_path("{INSTALLER.relative_to(ROOT).as_posix()}")'
    assert run in code and "pip" not in code, "the first code cell runs colab/setup/install.py"


def test_the_installer_installs_its_clone(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "check_call", calls.append)
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(INSTALLER))
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "-e", str(ROOT)]]
    assert sys.path[0] == str(ROOT)


def test_kernel_is_this_interpreter():
    """nbclient's "python3" kernel runs this interpreter (the venv with the package installed)."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    assert km.format_kernel_cmd()[0] == sys.executable


@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [pytest.param(p, marks=run_marks(p)) for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_runs_top_to_bottom(source, tmp_path, monkeypatch):
    """Executes the notebook in `tmp_path` (its working directory: runs write there); afterwards
    no process it started may still be alive."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(
        "JAX_COMPILATION_CACHE_DIR",
        os.environ.get("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache")),
    )
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = jupytext.read(source)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    t0 = time.monotonic()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        logs = sorted(tmp_path.glob("**/logs/*.log"))  # engine processes' logs, if it started any
        tails = "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-2000:]}" for p in logs)
        raise AssertionError(f"{source.name} failed:\n{e}\n{tails}") from None
    finally:
        deadline = time.monotonic() + 60  # liveness, not speed
        while (left := engine_pids(str(tmp_path))) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:  # started by this notebook run (they name its directory): end them
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    print(f"{source.name}: {time.monotonic() - t0:.1f} s")
    assert not left, f"{source.name} left processes running: {left}"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
