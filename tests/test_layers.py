"""The package's layers: no import cycle between its modules, and no import from a lower layer to
a higher one. Every import counts: at module level, inside functions, under `TYPE_CHECKING`, and
the names a curated namespace resolves lazily (its `_EXPORTS`). The order is `LAYERS`, and
docs/architecture.md ("Layers") shows the same stack. Modules stay small (`MAX_LINES`)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dualpath_jax"

# Bottom to top. A module belongs to the most specific entry naming it or a package above it
# (`__init__` is the package's own module); it may import modules of its own layer and below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "__init__",
            "config",
            "configs_loader",
            "_compiled",
            "copies",
            "kv_events",
            "logs",
            "results",
            "presets.models",
            "presets.hardware",
        ),
    ),
    ("kernels", ("kernels",)),
    ("model", ("model",)),
    ("storage and scheduling", ("kvstore", "sched")),
    ("transfer", ("transfer",)),
    ("support", ("testing", "presets", "workload", "metrics", "analysis")),
    ("wire", ("wire",)),
    ("engines and router", ("engines", "router")),
    ("runtimes", ("runtimes", "sim")),
    ("serving", ("serving",)),
    (
        "programs",
        (
            "cluster",
            "rollout",
            "experiment",
            "demo",
            "launcher",
            "native",
        ),
    ),
)


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package (packages by their `__init__.py`)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The module `name` imports: itself, else its longest prefix that is a module."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _imports(module: str) -> set[str]:
    """The package's modules `module` imports, wherever in the file."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import name`: the submodule `pkg.name` if there is one, else `pkg`.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                         for a in node.names)  # fmt: skip
        elif (
            path.name == "__init__.py"
            and isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
        ):
            # A curated namespace's lazy names: `{name: submodule or full module path}`.
            for c in ast.walk(node.value):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    for cand in (c.value, f"{package}.{c.value}"):
                        if cand.startswith("dualpath_jax.") and cand in MODULES:
                            found.add(cand)
    return {m for m in map(_known, found) if m is not None and m != module}


GRAPH = {m: _imports(m) for m in MODULES}


def layer_of(module: str) -> int:
    rel = module.removeprefix("dualpath_jax").removeprefix(".") or "__init__"
    best, depth = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (rel == m or rel.startswith(m + ".")) and m.count(".") > depth:
                best, depth = i, m.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and the docs)"
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_imports():
    assert "dualpath_jax.kernels.paged_attention" in GRAPH["dualpath_jax.model.layers"]
    # function-local, and a curated namespace's lazy names
    assert "dualpath_jax.testing.faulty" in GRAPH["dualpath_jax.engines.fault_hook"]
    assert "dualpath_jax.model.runner" in GRAPH["dualpath_jax.model"]
    assert "dualpath_jax.presets.models" in GRAPH["dualpath_jax.model"]
    assert "dualpath_jax.presets.calibration" in GRAPH["dualpath_jax.presets"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_no_import_reaches_up_a_layer():
    names = [name for name, _ in LAYERS]
    upward = [
        f"{m} ({names[layer_of(m)]}) imports {t} ({names[layer_of(t)]})"
        for m in sorted(GRAPH)
        for t in sorted(GRAPH[m])
        if layer_of(t) > layer_of(m)
    ]
    assert upward == []


# The soft cap on a module's length (STYLE.md habit 9): a module past it is split into modules
# named for what they hold.
MAX_LINES = 600


def test_no_module_is_longer_than_the_cap():
    long = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: split them"


def test_the_architecture_doc_shows_these_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Layers\n.*?```text\n(.*?)```", text, re.S | re.M)
    assert block, "docs/architecture.md needs a '## Layers' section with a ```text block"
    shown: list[tuple[str, tuple[str, ...]]] = []
    for line in block.group(1).splitlines():
        if line.startswith(" ") and line.strip():  # a wrapped line: more of the layer above
            name, members = shown.pop()
            shown.append((name, members + tuple(m.strip() for m in line.split(",") if m.strip())))
        elif line.strip():
            name, members = line.split(":", 1)
            shown.append((name.strip(), tuple(m.strip() for m in members.split(",") if m.strip())))
    assert shown == list(reversed(LAYERS)), "the doc lists the layers top to bottom"


# Wings of one layer that stand side by side: neither imports the other (the router routes, the
# engines compute; both speak the wire).
SIDE_BY_SIDE = (("engines", "router"), ("runtimes", "sim"))


def test_side_by_side_wings_do_not_import_each_other():
    def wing(m: str) -> str:
        return m.removeprefix("dualpath_jax.").split(".")[0]

    crossing = [
        f"{m} imports {t}"
        for pair in SIDE_BY_SIDE
        for m in sorted(GRAPH)
        for t in sorted(GRAPH[m])
        if {wing(m), wing(t)} == set(pair)
    ]
    assert crossing == []


# A folder is a wing small enough to know by heart (STYLE.md habit 20).
MAX_MODULES = 20


def test_no_folder_holds_more_than_the_cap():
    big = {
        str(d.relative_to(ROOT)): n
        for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > MAX_MODULES
    }
    assert big == {}, f"folders over {MAX_MODULES} modules: split them by role"
