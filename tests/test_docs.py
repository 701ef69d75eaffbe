"""What README.md and docs/ name exists: every test file they point at, every flag they show, every
class and function of convoy they name.

A page that names a moved test, a renamed flag or a class that is gone teaches what no longer runs.
"""
from __future__ import annotations

import argparse
import builtins
import re
from pathlib import Path

from torch.distributed.run import get_args_parser

from convoy.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Classes the pages show in `code` that are torch's, not convoy's (Python's own are known by builtins).
FOREIGN_NAMES = {"DistributedDataParallel", "DynamicRendezvousHandler", "Dataset", "Flatten", "Future",
                 "HierarchicalModelAverager", "Linear", "Parameter", "ParallelDims", "PowerSGDState"}
# Flags the pages show that belong to other programs, or to a mistake shown on purpose.
FOREIGN_FLAGS = {
    "--logdir": "tensorboard's",
    "--modle": "docs/cli.md shows the error a misspelt flag gets",
}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(option for option in action.option_strings if option.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def _script_flags() -> set[str]:
    """The flags bench/ and examples/ scripts declare (their parsers are built inside main())."""
    scripts = [*(ROOT / "bench").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    return {flag for path in scripts for flag in re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', path.read_text())}


def _named(pattern: str) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    for page in PAGES:
        for match in re.finditer(pattern, page.read_text()):
            named.setdefault(match.group(1), []).append(page.name)
    return named


def test_every_test_file_the_pages_name_exists():
    missing = {path: pages for path, pages in _named(r"(tests/[\w/]+\.py)").items() if not (ROOT / path).exists()}
    assert not missing


def test_every_flag_the_pages_name_exists():
    known = _flags(build_parser()) | _flags(get_args_parser()) | _script_flags() | set(FOREIGN_FLAGS)
    unknown = {flag: pages for flag, pages in _named(r"(?<![\w-])(--[a-z][a-z0-9-]*)").items() if flag not in known}
    assert not unknown


def _defined_in_convoy() -> set[str]:
    """Every class, function, method and module-level name defined in convoy/."""
    names: set[str] = set()
    for path in (ROOT / "convoy").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"^\s*(?:class|def) (\w+)", text, re.M)) | set(re.findall(r"^(\w+)\s*[:=]", text, re.M))
    return names


def test_every_class_the_pages_name_exists():
    # A CamelCase name in `code` (alone, dotted after convoy's modules, or with a method): a class of convoy's.
    named = _named(r"`(?:convoy\.[\w.]*\.)?([A-Z][a-z]+[A-Z]?\w*)(?:\.\w+)?(?:\(\))?`")
    known = _defined_in_convoy() | FOREIGN_NAMES | set(dir(builtins))
    missing = {name: pages for name, pages in named.items() if name not in known}
    assert not missing
