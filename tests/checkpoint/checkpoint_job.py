"""A small, deterministic training job for the checkpoint crash tests, a fork server for it, and its client.

LeNet on 128 fixed random images, world of one, batch 16 (8 steps an
epoch), through the engine and the checkpoint listener, resuming by itself
when its directory holds a checkpoint. ``reference_trace`` runs the same job
in-process without checkpoints and records the state after every step.

Starting Python and importing torch costs seconds; a crash test needs dozens
of runs. ``python tests/checkpoint/checkpoint_job.py serve`` imports everything
once and then, per line on stdin, forks a fresh training process
(:class:`ForkServer` is the tests' side of it):

    run DIR STEPS KILL DELAY [COMPRESS]  ->  pid PID  (KILL: a faults kill point or "-")
    reap PID                   ->  status STATUS  (os.waitpid's status)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run as a script: the checkout

from convoy import AllReduce, Engine  # noqa: E402
from convoy.checkpoint import CheckpointSettings, faults, start_checkpointing  # noqa: E402
from convoy.checkpoint.recovery import scan, state_dict_of, valid_steps  # noqa: E402
from convoy.checkpoint.store import Store  # noqa: E402
from convoy.compress import build_compressor  # noqa: E402
from convoy.models.lenet import lenet  # noqa: E402

BATCH, SAMPLES = 16, 128
STEPS_PER_EPOCH = SAMPLES // BATCH
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
FULL_EVERY = 4   # differential checkpoints (a compressed job): a full snapshot every 4 checkpoints
RANK_FILES = "full"   # blocktopk's rank files only with the full snapshots: the resumes replay (what is tested)


def build_job(compress: str = "none"):
    """(model, engine, images, labels) of the job, initialised from fixed seeds."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 1, 32, 32, generator=generator)
    y = torch.randint(0, 10, (SAMPLES,), generator=generator)
    torch.manual_seed(0)
    model = lenet()
    # "blocktopk-global": blocks chosen on summed scores (a memory update that reads the peers').
    name, _, selection = compress.partition("-")
    # Every lenet layer cut into whole-row blocks, so each one's checkpoint holds a sparse update.
    compressor, memory = build_compressor(name, block_selection=selection or "local", block_size=None,
                                          dense_below=0)
    return model, Engine(model, torch.optim.SGD, AllReduce(None, compressor, memory), **HYPER), x, y


def batch_indices(step: int) -> torch.Tensor:
    """Sample indices of ``step``: a shuffled order per epoch, like GlobalBatchSampler."""
    epoch, position = divmod(step, STEPS_PER_EPOCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))
    return order[position * BATCH:(position + 1) * BATCH]


def train(model, engine, x, y, start_step: int, steps: int, after_step=None) -> None:
    for step in range(start_step, steps):
        index = batch_indices(step)
        engine.backward(F.cross_entropy(model(x[index]), y[index]))
        if after_step is not None:
            after_step(step + 1)
    engine.synchronize()


def state_of(model, engine) -> dict[str, torch.Tensor]:
    """Parameters, momentum buffers and error-feedback residuals by name (what a checkpoint must reproduce)."""
    out = {f"param:{k}": v.detach().clone() for k, v in model.named_parameters()}
    out.update({f"sync:{k}": v.clone() for k, v in engine.sync.state_tensors().items()})
    for layer, opt in zip(engine.layers, engine.optimizers):
        for i, p in enumerate(layer.params):
            out[f"momentum:{layer.name}.{i}"] = opt.state[p]["momentum_buffer"].clone()
    return out


def reference_trace(steps: int, compress: str = "none") -> dict[int, dict[str, torch.Tensor]]:
    """The state after each step count 1..steps of an uninterrupted run."""
    model, engine, x, y = build_job(compress)
    trace = {}

    def record(done: int) -> None:
        engine.synchronize()
        trace[done] = state_of(model, engine)

    train(model, engine, x, y, 0, steps, record)
    engine.close()
    return trace


def main(directory: str, steps: int, compress: str = "none") -> int:
    """Train to ``steps`` with checkpoints in ``directory`` (resuming from it); return the start step."""
    model, engine, x, y = build_job(compress)
    session = start_checkpointing(CheckpointSettings(directory, full_every=FULL_EVERY, rank_files=RANK_FILES), model,
                                  engine, torch.optim.SGD, HYPER,
                                  total_steps=steps, steps_per_epoch=STEPS_PER_EPOCH)
    train(model, engine, x, y, session.start.step, steps)
    engine.close()
    session.listener.close()
    return session.start.step


def serve() -> None:
    # The first optimizer imports torch._dynamo (seconds): pay that once, before forking.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "run":
            directory, steps, kill, delay, *compress = args
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)
                    faults.configure("" if kill == "-" else kill, float(delay))
                    main(directory, int(steps), *compress)
                except BaseException as exc:  # reported through stderr and the exit status
                    print(f"worker failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    code = 1
                os._exit(code)
            print(f"pid {pid}", flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            print(f"status {status}", flush=True)


class ForkServer:
    """A ``serve`` process of this module, and the commands the tests send it."""

    def __init__(self, stderr_path: Path):
        from tests.helpers import require_timeout

        require_timeout("starts a fork server")
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, bufsize=1)

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()[1]

    def run(self, directory: Path, steps: int, kill: str = "-", delay: float = 0.0, compress: str = "") -> int:
        """Fork a run training to ``steps`` in ``directory``; return its pid."""
        return int(self._ask(f"run {directory} {steps} {kill} {delay} {compress}".rstrip()))

    def reap(self, pid: int) -> int:
        """Wait for run ``pid``; return os.waitpid's status."""
        return int(self._ask(f"reap {pid}"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._stderr.close()


def recovered(directory: Path):
    """(step, parameters, optimizer states) of the newest step valid in both files; None before any commit."""
    model_path, rank_path = directory / "model-rank0.ckpt", directory / "state-rank0.ckpt"
    if not model_path.exists():
        return None
    store = Store.open(model_path)
    try:
        reports = scan(store, store.layout.signature())
        if all(r.empty for r in reports):
            return None
        rank_store = Store.open(rank_path)
        rank_steps = valid_steps(scan(rank_store))
        rank_store.close()
        steps = set(valid_steps(reports)) & set(rank_steps)
        assert steps, [r.describe() for r in reports]
        step = max(steps)
        params, states = state_dict_of(store, valid_steps(reports)[step].area)
        return step, params, states
    finally:
        store.close()


def assert_matches_trace(result, trace) -> None:
    """Fail unless ``recovered``'s result equals, bit for bit, the uninterrupted run's state after its step."""
    step, params, states = result
    expected = trace[step]
    for key, tensor in expected.items():
        kind, name = key.split(":", 1)
        if kind == "param":
            got = params[name]
        else:
            layer, index = name.rsplit(".", 1)
            got = states[layer][int(index)]["momentum_buffer"]
        assert torch.equal(got, tensor), f"step {step}: {key} differs from the uninterrupted run"


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["serve"] else print(f"resumed from step {main(sys.argv[1], int(sys.argv[2]))}")
