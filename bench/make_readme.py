"""bench/README.md, and every figure block of the docs, generated from bench/results/*.json.

    python bench/make_readme.py           # rewrite bench/README.md and the blocks in README.md, docs/*.md
    python bench/make_readme.py --check   # exit 1, naming the stale files, when any differs

A figure in the documentation is never typed: each table sits between two markers,

    <!-- bench:NAME -->
    ...generated...
    <!-- /bench:NAME -->

and this script rewrites what is between them from the result files the benchmarks
wrote (``{"machine", "settings", "rows"}``, see bench/common.py). The tables
themselves are drawn beside the benchmark that measured them: each module named in
BENCHES holds a ``BLOCKS`` tuple (bench/figures.py's Block: the marker's name, the
result files, the peer, the renderer). This script adds the command the result files
recorded and the machine they ran on. bench/README.md holds every block in BENCHES'
order; a result file no block names still gets a plain table there, so a new
benchmark shows up before it has a renderer. tests/bench/test_bench_figures.py fails
when the committed files differ from this script's output.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import figures  # noqa: E402
from bench.figures import Block, load, number, table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH_README = ROOT / "bench" / "README.md"
MARKER = re.compile(r"(<!-- bench:([\w.-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)

# The benchmark modules whose BLOCKS the pages show, in bench/README.md's order.
BENCHES = ("default_job", "engine_vs_ddp", "cluster_allreduce", "checkpoint", "ddp_hook_stress", "cuda_paths",
           "train_through_failures", "stop_flag", "compression.selection", "compression.wire_bytes",
           "compression.accuracy", "powersgd_step", "sparse_accuracy", "sparse_block_size", "time_to_accuracy",
           "steps_across_seeds", "ps_settings", "link_patterns", "staleness_rules", "training_guards", "hybrid",
           "hierarchical", "ps", "suite", "accuracy_at_budget", "simulator_runs", "simulator_validation",
           "simulator_checks", "plan_time_to_target", "simulator_projection")


class RenderError(Exception):
    """A block's renderer failed on its result files (a benchmark changed its columns, a file is broken)."""


@lru_cache(maxsize=None)
def blocks() -> dict[str, Block]:
    """Every block of the modules in BENCHES, by marker name, in order."""
    found: dict[str, Block] = {}
    for module in BENCHES:
        for block in importlib.import_module(f"bench.{module}").BLOCKS:
            if block.name in found:
                raise ValueError(f"figure block '{block.name}' is defined twice (again in bench/{module})")
            found[block.name] = block
    return found


# 1. One block: the benchmark's table, then the command and where it ran ----------------------

def measured_on(*names: str) -> str:
    """Where and when: the machine line of the result files (their commits and dates)."""
    stamps = []
    for name in names:
        data = load(name)
        if data and "machine" in data:
            m = data["machine"]
            cpu = f", {m['cpu']}" if m.get("cpu") else ""
            stamps.append(f"{m.get('date', '?')[:10]}, commit {m.get('commit', '?')}{cpu}")
    if not stamps:
        return ""
    first = load(names[0])["machine"] if load(names[0]) else {}
    where = f"{first.get('cpus', '?')} CPUs, torch {first.get('torch', '?')}"
    return f"Measured on {where} ({'; '.join(sorted(set(stamps)))})."


def recorded(name: str) -> str | None:
    """The command bench/results/<name>.json recorded as it ran (bench/common.py's machine()), if it did."""
    data = load(name)
    return data.get("machine", {}).get("command") if data else None


def command_line(block: Block) -> str:
    """The block's command: the ones its result files recorded as they ran. A file measured before the
    benchmarks recorded theirs is said to have none; the block's rerun text says how to measure it again."""
    measured = [name for name in block.sources if load(name)]
    commands = "; ".join(dict.fromkeys(c for name in measured if (c := recorded(name))))
    missing = [name for name in measured if not recorded(name)]
    if not missing:
        return f"Command: `{commands}`"
    which = "" if len(missing) == len(measured) else \
        f" for {', '.join(f'{name}.json' for name in missing)} (recorded for the others: `{commands}`)"
    return (f"Command: not recorded{which}: measured before the benchmarks recorded their command line; "
            f"to measure again: `{block.rerun}`")


def _renderer(block: Block) -> str:
    func = getattr(block.render, "func", block.render)   # a functools.partial names its function
    return f"{func.__module__}.{func.__qualname__}"


def render_block(name: str) -> str:
    """The text between a block's markers: the table, then the command and the peer.

    A renderer that fails fails the run, naming the block: --check must not pass over it.
    """
    block = blocks()[name]
    if not any(load(s) for s in block.sources):
        return f"(not measured yet: `{block.rerun}`)\n"
    stamp = measured_on(*block.sources)
    try:
        body = block.render()
    except Exception as exc:
        raise RenderError(f"figure block '{name}' ({_renderer(block)}) failed on bench/results/"
                          f"{{{', '.join(block.sources)}}}.json: {type(exc).__name__}: {exc}") from exc
    where = " (as root, under `flock /tmp/convoy-netns.lock`: it builds emulated hosts)" if block.emulated else ""
    return (f"{body}\n\n{command_line(block)}{where}. Compared with: {block.peer}. {stamp}\n"
            f"Generated by `python bench/make_readme.py` from bench/results/{block.sources[0]}.json"
            f"{' and others' if len(block.sources) > 1 else ''}; do not edit.\n")


# 2. Files no block names: a plain table, so new benchmarks show up ------------------------

def _plain(name: str, data: dict[str, Any]) -> str:
    rows = data.get("rows", [])
    columns = [c for c in dict.fromkeys(k for r in rows for k in r)
               if all(not isinstance(r.get(c), (list, dict)) for r in rows)]
    body = table(columns, [[number(r.get(c), "") for c in columns] for r in rows]) if rows else "(no rows)"
    command = f"Command: `{recorded(name)}`. " if recorded(name) else ""
    return f"### {name}\n\n{body}\n\n{command}Settings: `{json.dumps(data.get('settings', {}))}`. {measured_on(name)}\n"


def unclaimed() -> list[str]:
    claimed = {s for b in blocks().values() for s in b.sources}
    names = []
    for path in sorted(figures.RESULTS.glob("*.json")):
        if path.stem in claimed:
            continue
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            names.append(path.stem)
    return names


# 3. The files -------------------------------------------------------------------------------

HEADER = """# Benchmarks: every measured figure

Generated by `python bench/make_readme.py` from `bench/results/*.json`; do not edit
(tests/bench/test_bench_figures.py checks this file against the script). Each table says
the command that measured it and the peer it is compared with. The machine is a
2-core x86 CPU VM with torch 2.13.0 CPU and gloo, one torch thread per worker, often
shared with other jobs: absolute times are inflated and noisy, ratios measured inside
one run are what to read. What the figures mean, and where they fall short of their
goals, is in the capability pages under docs/ (docs/benchmarks.md lists them).
"""


def render_bench_readme() -> str:
    parts = [HEADER]
    for block in blocks().values():
        parts.append(f"## {block.title}\n\n<!-- bench:{block.name} -->\n{render_block(block.name)}"
                     f"<!-- /bench:{block.name} -->\n")
    extra = unclaimed()
    if extra:
        parts.append("## Other result files\n\nNo section above reads these yet; each as written.\n")
        parts += [_plain(name, json.loads((figures.RESULTS / f"{name}.json").read_text())) for name in extra]
    return "\n".join(parts)


def refresh_blocks(text: str) -> str:
    """``text`` with every known ``<!-- bench:NAME -->`` block regenerated."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in blocks():
            raise ValueError(f"unknown figure block '{name}'; known: {', '.join(blocks())}")
        return f"{match.group(1)}{render_block(name)}{match.group(4)}"
    return MARKER.sub(replace, text)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def expected_files() -> dict[Path, str]:
    """Every generated file's expected text: bench/README.md, and each document with blocks."""
    files = {BENCH_README: render_bench_readme()}
    for path in documents():
        if path.exists():
            files[path] = refresh_blocks(path.read_text())
    return files


def stale_files() -> list[Path]:
    return [p for p, text in expected_files().items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    try:
        expected = expected_files()
    except RenderError as exc:
        print(f"make_readme: {exc}", file=sys.stderr)
        return 1
    if args.check:
        stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run python bench/make_readme.py)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
