"""Installs the clone of the repository this file is in, for a notebook whose kernel cannot import
`dualpath_jax` yet (on Colab: a copy of the repository uploaded and `%cd`-ed into).

Every notebook's first code cell runs it, from the clone's root, only when the package is missing:

    runpy.run_path("colab/setup/install.py")

It runs `pip install -e` on the clone and puts the clone on `sys.path`, since the kernel started
before the install (an editable install's path hook only acts in a new interpreter).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if not (ROOT / "pyproject.toml").is_file():
    raise RuntimeError(f"{ROOT} is not a clone of the repository: run `pip install -e .` in one")
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(ROOT)])
sys.path.insert(0, str(ROOT))
