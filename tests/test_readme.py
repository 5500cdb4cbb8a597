"""The README is a user's guide: at most ~15 KB, and its quick-start Python runs as written."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_stays_a_guide():
    text = README.read_text()
    assert len(text.encode()) <= 15_000
    assert text.index("## Quick start") < text.index("## What runs where")
    assert "docs/results.md" in text  # the figures live there


def test_the_quickstart_uses_at_most_three_imports():
    quickstart = python_blocks(README.read_text())[0]
    imports = [ln for ln in quickstart.splitlines() if re.match(r"(from \S+ )?import ", ln)]
    assert 1 <= len(imports) <= 3, imports


@pytest.mark.multiprocess  # its LocalCluster starts engine processes
def test_the_quickstart_runs_as_written(tmp_path):
    # Run from a scratch directory holding the configs, so the run's files land there.
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    script = tmp_path / "quickstart.py"
    script.write_text(python_blocks(README.read_text())[0])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    first, second = proc.stdout.strip().splitlines()[-1].split("] [")
    assert len(first.strip("[").split(",")) == 8 and len(second.strip("]").split(",")) == 4
    assert (tmp_path / "runs" / "quickstart").is_dir()


def test_the_model_example_runs(tmp_path):
    block = next(b for b in python_blocks(README.read_text()) if "model.generate(" in b)
    block = block.replace('"/tmp/ckpt"', repr(str(tmp_path / "ckpt")))
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert isinstance(scope["tokens"], list) and len(scope["tokens"]) == 8
    assert (tmp_path / "ckpt").exists()
