"""The package layout is the architecture: import-linter's contracts in pyproject.toml hold, and no import cycle."""
from __future__ import annotations

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
