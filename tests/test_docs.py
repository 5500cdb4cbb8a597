"""docs/: every `>>>` example runs, every launcher command names a real script and real flags,
every page is linked from the index."""

from __future__ import annotations

import doctest
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

# Flags absl defines for every app (`--helpfull` etc.), not in the scripts' DEFINE_* calls.
ABSL_BUILTIN = {
    "help",
    "helpfull",
    "helpshort",
    "flagfile",
    "alsologtostderr",
    "logtostderr",
    "verbosity",
    "v",
    "log_dir",
}
DEFINE = re.compile(r"DEFINE_(\w+)\(\s*[\"'](\w+)[\"']")
COMMAND = re.compile(r"python3? ((?:launch|bench)/\w+\.py)([^`#\n]*)")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z_][\w-]*)")
ARGPARSE = re.compile(r"add_argument\(\s*[\"']--([\w-]+)[\"']")


def script_flags(script: pathlib.Path) -> set[str]:
    """Flags a launcher defines (its own DEFINE_* calls plus those of `launch/_flags.py` if it
    imports it, and argparse's `add_argument("--name")`); boolean flags also as `no<name>`."""
    sources = [script.read_text()]
    if re.search(r"^import _flags\b", sources[0], flags=re.M):
        sources.append((ROOT / "launch" / "_flags.py").read_text())
    names = set()
    for text in sources:
        names.update(ARGPARSE.findall(text))
        for kind, name in DEFINE.findall(text):
            names.add(name)
            if kind in ("bool", "boolean"):
                names.add(f"no{name}")
    return names


def doc_commands() -> list[tuple[str, str, str]]:
    """`(page, script, argument text)` of every `python launch/...` / `python bench/...` command
    in the docs, shell line continuations joined."""
    out = []
    for page in [*PAGES, ROOT / "README.md"]:
        text = page.read_text().replace("\\\n", " ")
        out += [(page.name, m.group(1), m.group(2)) for m in COMMAND.finditer(text)]
    return out


def test_docs_exist():
    names = {p.name for p in PAGES}
    assert {
        "index.md",
        "architecture.md",
        "policies.md",
        "configs.md",
        "launchers.md",
        "traces.md",
        "emulation.md",
        "failures.md",
        "multihost.md",
        "api.md",
    } <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_doc_examples_run(page, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # examples use paths relative to the repository root
    result = doctest.testfile(
        str(page),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    report = capsys.readouterr().out
    assert result.failed == 0, report


def test_commands_name_real_scripts_and_flags():
    commands = doc_commands()
    assert len(commands) > 20
    problems = []
    for page, script, args in commands:
        path = ROOT / script
        if not path.is_file():
            problems.append(f"{page}: {script} does not exist")
            continue
        known = script_flags(path) | ABSL_BUILTIN
        problems += [
            f"{page}: {script} has no flag --{f}" for f in FLAG.findall(args) if f not in known
        ]
        problems += [
            f"{page}: {script} --config={c} does not exist"
            for c in re.findall(r"--config=(\S+?\.py)", args)
            if not (ROOT / c).is_file()
        ]
    assert not problems, "\n".join(problems)


def test_script_and_config_mentions_exist():
    missing = []
    for page in PAGES:
        for rel in set(re.findall(r"(?<![\w/])((?:launch|bench)/\w+\.py)", page.read_text())):
            if not (ROOT / rel).is_file():
                missing.append(f"{page.name}: {rel}")
    assert not missing, missing


def test_index_links_every_page_and_links_resolve():
    index = (DOCS / "index.md").read_text()
    assert [p.name for p in PAGES if p.name != "index.md" and f"({p.name})" not in index] == []
    broken = [
        f"{page.name} -> {target}"
        for page in PAGES
        for target in re.findall(r"\]\(([\w.-]+\.md)\)", page.read_text())
        if not (DOCS / target).is_file()
    ]
    assert not broken, broken
