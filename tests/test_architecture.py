"""The package layout is the architecture: import-linter's contracts in pyproject.toml hold, no import cycle,
and the packages meet only through declared interfaces (no probing, no attribute injection, no private imports)."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT



@pytest.mark.timeout(120)
def test_dependencies_flow_one_way() -> None:
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert command, "import-linter is a test dependency: pip install -e '.[test]'"
    done = subprocess.run([command, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.timeout(120)
def test_no_module_imports_one_that_imports_it_back_even_for_annotations() -> None:
    """pyproject.toml's acyclic contract counts the imports that run; a ``TYPE_CHECKING`` import is
    still a dependency of the file's design, so no cycle may close through one either."""
    grimp = pytest.importorskip("grimp", reason="import-linter's graph builder is a test dependency")
    graph = grimp.build_graph("convoy", exclude_type_checking_imports=False, cache_dir=None)
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append(" -> ".join((importer, *back)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# Attribute names a convoy file may set on an object other than ``self``/``cls``, each with why.
ALLOWED_FOREIGN_ATTRIBUTES = {
    "grad": "torch's own interface: a parameter's gradient is given by setting Tensor.grad",
}


def _convoy_sources() -> list[tuple[str, str]]:
    files = sorted((ROOT / "convoy").rglob("*.py"))
    assert files, ROOT
    return [(str(f.relative_to(ROOT)), f.read_text()) for f in files]


def _assigned(target: ast.expr) -> list[ast.expr]:
    """The single targets of an assignment target (tuples and starred ones unpacked)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [leaf for element in target.elts for leaf in _assigned(element)]
    if isinstance(target, ast.Starred):
        return _assigned(target.value)
    return [target]


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _reaching_in(path: str, text: str) -> list[str]:
    """Where ``text`` probes a sync strategy (``getattr``/``hasattr`` on an expression naming one) or
    sets an attribute of an object other than ``self``/``cls`` (``x.a = ``, ``self.x.a = ``, ``setattr(x, ``)."""
    found = []
    for node in ast.walk(ast.parse(text, path)):
        where = f"{path}:{getattr(node, 'lineno', 0)}: "
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            first = ast.get_source_segment(text, node.args[0]) or ""
            if node.func.id in ("getattr", "hasattr") and "sync" in first:
                found.append(where + f"probes a sync strategy: {ast.get_source_segment(text, node)}")
            if node.func.id == "setattr" and not _is_self(node.args[0]):
                found.append(where + f"sets another object's attribute: {ast.get_source_segment(text, node)}")
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in (leaf for t in targets for leaf in _assigned(t)):
            if (isinstance(target, ast.Attribute) and not _is_self(target.value)
                    and target.attr not in ALLOWED_FOREIGN_ATTRIBUTES):
                found.append(where + f"sets another object's attribute: {ast.get_source_segment(text, target)}")
    return found


def test_the_seam_check_finds_each_kind_of_reaching_in() -> None:
    bad = ('memory = getattr(engine.sync, "memory", None)\n'
           'engine.sync.replay = feed\n'
           'self.engine.sync.replay = None\n'
           'a.x, b.y = 1, 2\n'
           'stats.bytes += 1\n'
           'setattr(profile, name, 1)\n')
    assert len(_reaching_in("bad.py", bad)) == 7
    good = ('self.x = 1\n'
            'cls.y = 2\n'
            'p.grad = view\n'
            'value = getattr(config, name)\n'
            'setattr(self, slot, 1)\n'
            'self.schedule.end_at(step)\n')
    assert _reaching_in("good.py", good) == []


def test_nothing_reaches_into_a_sync_strategy_or_sets_attributes_on_another_object() -> None:
    """Sync strategies are read through :class:`convoy.core.SyncStrategy`'s declared interface, not
    probed with ``getattr``; an object's attributes are set by its own methods (``self.x = ...``),
    never from outside (``other.x = ...``, ``self.other.x = ...``, ``setattr(other, ...)``)."""
    found = [line for path, text in _convoy_sources() for line in _reaching_in(path, text)]
    assert not found, "\n".join(found)


def test_no_module_imports_another_ones_private_names() -> None:
    """A leading underscore means "this module's own": another module importing it makes it an
    interface nobody declared."""
    found = [f"{path}:{node.lineno}: from {node.module} import {alias.name}"
             for path, text in _convoy_sources() for node in ast.walk(ast.parse(text, path))
             if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("convoy"))
             for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not found, "\n".join(found)


# The one module that creates process groups: torch needs every rank to create every group, in one order.
GROUP_OWNERS = {"convoy/parallel/groups.py"}


def _creates_groups(path: str, text: str) -> list[str]:
    """Where ``text`` names ``new_group`` (a call, an alias, an import) or shows a call of it in a docstring."""
    named = {node.lineno for node in ast.walk(ast.parse(text, path))
             if (isinstance(node, ast.Attribute) and node.attr == "new_group")
             or (isinstance(node, ast.Name) and node.id == "new_group")
             or (isinstance(node, ast.alias) and node.name == "new_group")}
    return [f"{path}:{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), 1)
            if number in named or "new_group(" in line]


def test_the_group_check_finds_each_way_of_creating_a_group() -> None:
    bad = ('group = dist.new_group([0, 1])\n'
           'from torch.distributed import new_group\n'
           'make = torch.distributed.new_group\n'
           '"""\n    >>> AllReduce(dist.new_group())\n"""\n')
    assert len(_creates_groups("bad.py", bad)) == 4
    assert _creates_groups("good.py", 'sync = AllReduce(groups.engines[0])\ngroup = self.groups.agree\n') == []


def test_process_groups_are_created_only_where_the_job_owns_them() -> None:
    """Every ``dist.new_group`` of convoy is in :mod:`convoy.parallel.groups` (``ProcessGroups.create``
    and ``cluster_network``), so every rank creates the job's groups in one place and one order;
    components receive theirs."""
    found = [line for path, text in _convoy_sources() if path not in GROUP_OWNERS
             for line in _creates_groups(path, text)]
    assert not found, "\n".join(found)
