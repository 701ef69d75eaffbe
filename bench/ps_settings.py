"""The colocated servers' step under their transfer settings, against convoy's all-reduce in the same run.

    python bench/ps_settings.py --hosts 4 --rate 100mbit --model vgg_fc --steps 25

Each setting is one `convoy bench cluster` run (network namespaces + tbf; root
needed) of `--steps` steps without evaluation; the step is the mean period after
the first two steps (`time_to_accuracy.step_figures`). The defaults of
`--sync ps` (graph priority, 256 KB slices, a 512 KB acknowledged window per
peer, 2 channels) are the row every other ps row is compared with; the
settings that could bring its step nearer the ring all-reduce's are the rows.
The hosts run this machine's TCP congestion control unless `--tcp-congestion`
names one. Writes bench/results/ps_settings_<model>_<rate>[_<congestion>].{json,md}.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import launcher, save  # noqa: E402
from bench.figures import Block, rows_of, seconds, table, times  # noqa: E402
from bench.time_to_accuracy import step_figures  # noqa: E402

DEFAULT = "ps, defaults"
# --settings key -> (the row's name, convoy train options)
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "all-reduce": ("all-reduce", ["--sync", "allreduce"]),
    "ps": (DEFAULT, ["--sync", "ps"]),
    "ps-small": ("ps, 128 KB slices, 256 KB window", ["--sync", "ps", "--slice-kb", "128", "--credit-kb", "256"]),
    "ps-large": ("ps, 1 MB slices, 2 MB window", ["--sync", "ps", "--slice-kb", "1024", "--credit-kb", "2048"]),
    "ps-window-256": ("ps, 256 KB window", ["--sync", "ps", "--credit-kb", "256"]),
    "ps-window-1024": ("ps, 1 MB window", ["--sync", "ps", "--credit-kb", "1024"]),
    "ps-1-channel": ("ps, 1 channel", ["--sync", "ps", "--channels", "1"]),
    "ps-3-channels": ("ps, 3 channels", ["--sync", "ps", "--channels", "3"]),
    "ps-fifo": ("ps, fifo", ["--sync", "ps", "--priority", "fifo"]),
}


def run_setting(key: str, args: argparse.Namespace, out: Path) -> dict:
    name, options = SETTINGS[key]
    command = ["train", *options, "--model", args.model, "--lr", str(args.lr), "--batch-size",
               str(args.batch_size), "--steps", str(args.steps), "--eval-every", "0", "--no-progress",
               "--out", str(out)]
    result = subprocess.run(launcher(command, args.hosts, args.rate, tcp_congestion=args.tcp_congestion),
                            capture_output=True, text=True)
    if result.returncode != 0:
        return {"setting": name, "error": result.stderr.strip().splitlines()[-1] if result.stderr else "failed"}
    return {"setting": name, **step_figures(out, skip=2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", default="100mbit", help="each host's link, e.g. 100mbit")
    parser.add_argument("--model", default="vgg_fc")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--tcp-congestion", metavar="NAME", help="the hosts' TCP congestion control, e.g. cubic "
                        "(default: this machine's); the results' names end in _NAME")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, key in enumerate(args.settings):
            rows.append(run_setting(key, args, Path(tmp, str(i))))
            print(rows[-1], flush=True)
    steps = {r["setting"]: r.get("step_s") for r in rows}
    for row in rows:
        step = row.get("step_s")
        row["vs_all_reduce"] = step / steps["all-reduce"] if step and steps.get("all-reduce") else None
        row["vs_ps_defaults"] = step / steps[DEFAULT] if step and steps.get(DEFAULT) else None
    suffix = f"_{args.tcp_congestion}" if args.tcp_congestion else ""
    save(f"ps_settings_{args.model}_{args.rate}{suffix}", vars(args), rows,
         ["setting", "step_s", "vs_all_reduce", "vs_ps_defaults", "MB_sent/step", "error"])


# The documentation's figures from the results above (bench/make_readme.py writes them into the pages).

def render_ps_settings(name: str) -> str:
    return table(["setting", "step", "step / all-reduce step", "step / ps defaults' step"],
                 [[r["setting"], seconds(r.get("step_s")) if "error" not in r else f"failed: {r['error']}",
                   times(r.get("vs_all_reduce")), times(r.get("vs_ps_defaults"))] for r in rows_of(name)])


BLOCKS = (
    Block("ps_settings", "The colocated step under its transfer settings, vgg_fc, 4 hosts at 100 Mbit",
          ("ps_settings_vgg_fc_100mbit",), "convoy's ring all-reduce and the ps defaults, in the same run",
          partial(render_ps_settings, "ps_settings_vgg_fc_100mbit"),
          rerun="python bench/ps_settings.py --hosts 4 --rate 100mbit --model vgg_fc --steps 25", emulated=True),
    Block("ps_settings_cubic", "The colocated step under its transfer settings, hosts on TCP cubic",
          ("ps_settings_vgg_fc_100mbit_cubic",), "convoy's ring all-reduce and the ps defaults, in the same run",
          partial(render_ps_settings, "ps_settings_vgg_fc_100mbit_cubic"),
          rerun="python bench/ps_settings.py --hosts 4 --rate 100mbit --model vgg_fc --steps 25 "
                "--tcp-congestion cubic", emulated=True),
)


if __name__ == "__main__":
    main()
