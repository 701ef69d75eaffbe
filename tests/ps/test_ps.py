"""Parameter-server building blocks in one process: slicing, sharding, priorities, channels, settings."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from convoy.engine.layers import ForwardOrderRecorder
from convoy.errors import UsageError
from convoy.models import build_model
from convoy.ps import PSRoles, PSSettings
from convoy.ps.channels import channel_map
from convoy.ps.priority import graph_priorities, timed_priorities
from convoy.ps.routing import build_routing
from convoy.ps.scheduler import SliceScheduler, Transfer, stop_marks
from convoy.ps.job import PSJob
from convoy.ps.priority import PriorityPlan
from convoy.ps.sharding import link_shares, place_units, shard_layers, split_layers
from convoy.ps.slicing import cut, join, slice_table, split
from convoy.ps.trace_graph import Op, OpGraph, model_layers, trace


# ---------------------------------------------------------------- slicing
@given(numel=st.integers(0, 5000), slice_numel=st.integers(1, 700))
@settings(max_examples=200, deadline=None)
def test_slicing_round_trip_is_exact(numel, slice_numel):
    flat = torch.randn(numel)
    pieces = slice_table([numel], slice_numel * 4)[0]
    parts = split(flat, pieces)
    assert all(p.numel() <= slice_numel for p in parts)
    assert sum(p.numel() for p in parts) == numel
    assert torch.equal(join(parts), flat)          # bit for bit, odd sizes included


def test_cut_covers_odd_sizes_and_keeps_small_tensors_whole():
    assert cut(10, 3) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert cut(7, None) == [(0, 7)]
    assert cut(5, 5) == [(0, 5)]
    table = slice_table([10, 1, 7], slice_bytes=12)
    assert [p.id for pieces in table for p in pieces] == list(range(4 + 1 + 3))
    with pytest.raises(ValueError):
        cut(4, 0)


# --------------------------------------------------------------- sharding
def test_layers_are_sharded_by_bytes():
    assert shard_layers([100, 10, 60, 50], servers=2) == [0, 0, 1, 1]   # 110 B each
    model = build_model("vgg_fc", in_channels=1, num_classes=10)
    sizes = [sum(p.numel() * 4 for p in params) for _, _, params in model_layers(model)]
    owner = shard_layers(sizes, servers=2)
    loads = [sum(s for s, o in zip(sizes, owner) if o == server) for server in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(sizes)     # no better split moves a whole layer
    assert shard_layers(sizes, servers=1) == [0] * len(sizes)


def _rows(params: list) -> int | None:
    rows = {p.shape[0] for p in params}
    return rows.pop() if len(rows) == 1 else None


@pytest.mark.parametrize("name,servers", [("vgg_fc", 4), ("vgg_fc", 3), ("resnet18", 4)])
def test_colocated_units_give_every_server_an_equal_share_of_each_cut_layer(name, servers):
    layers = model_layers(build_model(name, in_channels=1, num_classes=10))
    units = split_layers([sum(p.numel() for p in params) for _, _, params in layers],
                         [_rows(params) for _, _, params in layers], servers)
    sizes = [sum(p[start:end].numel() * 4 for p in layers[i][2]) for i, start, end in units]
    owner = place_units(units, sizes, servers)
    cut = {i for i, start, _ in units if start is not None}
    largest = max(range(len(layers)), key=lambda i: sum(p.numel() for p in layers[i][2]))
    assert largest in cut
    for layer in cut:   # the next forward needs the layer whole: every server sends as much of it
        counts = [sum(1 for (i, _, _), o in zip(units, owner) if i == layer and o == s) for s in range(servers)]
        assert len(set(counts)) == 1, (layers[layer][0], counts)
    loads = [sum(size for size, o in zip(sizes, owner) if o == s) for s in range(servers)]
    assert max(loads) <= 1.05 * min(loads), loads


def _vgg_fc_units(servers: int) -> tuple[list, list[int]]:
    layers = model_layers(build_model("vgg_fc", in_channels=1, num_classes=10))
    units = split_layers([sum(p.numel() for p in params) for _, _, params in layers],
                         [_rows(params) for _, _, params in layers], servers)
    return units, [sum(p[start:end].numel() * 4 for p in layers[i][2]) for i, start, end in units]


@given(layers=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 400)), min_size=1, max_size=8),
       servers=st.integers(1, 5), weight=st.floats(0.1, 10))
@settings(max_examples=100, deadline=None)
def test_equal_shard_weights_place_units_as_no_weights(layers, servers, weight):
    units = [(i, k, k + 1) if parts > 1 else (i, None, None)
             for i, (parts, _) in enumerate(layers) for k in range(parts)]
    sizes = [layers[i][1] for i, _, _ in units]
    assert place_units(units, sizes, servers, [weight] * servers) == place_units(units, sizes, servers)


def _busiest_link(shares: list[float], rates: list[float]) -> float:
    """Seconds per model byte on the busiest link: (1 + (N - 2) f) of the model each way over rate r."""
    return max((1 + (len(rates) - 2) * f) / r for f, r in zip(shares, rates))


@given(rates=st.lists(st.floats(1, 100), min_size=3, max_size=6),
       other=st.lists(st.floats(0, 1), min_size=6, max_size=6))
@settings(max_examples=200, deadline=None)
def test_link_shares_leave_the_busiest_link_no_busier_than_any_other_split(rates, other):
    shares = link_shares(rates, least=0.0)
    assert abs(sum(shares) - 1) < 1e-9 and min(shares) >= 0
    rival = other[:len(rates)]
    if sum(rival) > 0:
        rival = [f / sum(rival) for f in rival]
        assert _busiest_link(shares, rates) <= _busiest_link(rival, rates) * (1 + 1e-9)
    assert _busiest_link(shares, rates) <= _busiest_link([1 / len(rates)] * len(rates), rates) * (1 + 1e-9)


def test_link_shares_place_vgg_fc_so_a_slow_link_carries_less_than_a_ring_would():
    rates = [100e6, 100e6, 100e6, 25e6]
    units, sizes = _vgg_fc_units(4)

    def held(weights) -> list[float]:
        owner = place_units(units, sizes, 4, weights)
        return [sum(b for b, o in zip(sizes, owner) if o == s) / sum(sizes) for s in range(4)]

    ring = _busiest_link(held(()), rates)
    assert ring == pytest.approx(1.5 / 25e6, rel=0.03)   # equal shares: every link carries 2 (N - 1) / N
    fitted = held(link_shares(rates))
    assert fitted[3] < 0.02 and all(0.3 < f < 0.37 for f in fitted[:3]), fitted
    assert _busiest_link(fitted, rates) < 0.72 * ring   # about 1 + 2 x 0.01 of the model instead of 1.5


def test_colocated_pushes_go_in_turns_one_stream_per_server():
    """At every position of their queues, the ranks push a cut layer's units to different servers
    (priority order alone would send every rank's first push to the same one)."""
    world = 4
    units = [(0, k, k + 1) for k in range(2 * world)] + [(1, None, None)]
    owner = place_units(units, [4] * len(units), world)
    plan = PriorityPlan("graph", tuple(range(len(units))), tuple(range(len(units))), {}, ())
    settings = PSSettings(servers=world, colocated=True, slice_bytes=None)
    routing = build_routing([1] * len(units), plan, settings, owner=owner)
    job = PSJob(PSRoles.colocate(world), settings, None, plan, [], {}, routing, routing, [], None, {},
                layer_rank=[0] * (len(units) - 1) + [len(units) - 1])
    queues = [sorted((job.order(routing, routing.table[u][0], rank, owner[u]), owner[u])
                     for u in range(len(units)) if owner[u] != rank) for rank in range(world)]
    for position in range(len(queues[0]) - 1):   # the cut layer's units: all but the last (whole) layer
        assert len({queue[position][1] for queue in queues}) == world, position
    assert all(queue[-1][0][0] == len(units) - 1 for queue in queues if queue[-1][1] == owner[-1])


# ------------------------------------------------------------- priorities
def _forward_order(model: nn.Module, example: torch.Tensor) -> list[str]:
    recorder = ForwardOrderRecorder(model)   # the engine's own record of forward order
    with torch.no_grad():
        model(example)
    return [layer.name for layer in recorder.finish()]


@pytest.mark.parametrize("name", ["lenet", "vgg_fc", "resnet18"])
def test_graph_priorities_follow_forward_order_first_conv_first(name):
    torch.manual_seed(0)
    model = build_model(name, in_channels=1, num_classes=10)
    example = torch.randn(2, 1, 32, 32)
    graph = trace(model, example)
    assert graph.method == "fx"
    plan = graph_priorities(graph)
    ordered = [graph.layer_names[i] for i in plan.order]
    assert ordered == _forward_order(model, example)
    first_conv = next(n for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    assert ordered[0] == first_conv
    priority = plan.parameter_priority(model)
    assert priority[f"{first_conv}.weight"] == 0
    assert sorted(set(priority.values())) == list(range(len(plan.order)))
    assert plan.op_priority[f"recv:{first_conv}"] == 0


def test_timed_priorities_equal_forward_order_on_a_chain():
    model = build_model("lenet", in_channels=1, num_classes=10)
    graph = trace(model, torch.randn(8, 1, 32, 32))
    timed = timed_priorities(graph, bandwidth=12.5e6)
    assert timed.order == graph_priorities(graph).order  # one op at a time can be unblocked
    arrivals = [timed.value[i] for i in timed.order]
    assert arrivals == sorted(arrivals) and arrivals[-1] < timed.upper_bound_s


def test_timed_priorities_are_explained_by_run_and_transfer_times():
    # Two independent branches joined at the end; program order runs a first.
    # a: 400 B of parameters (4 s at 100 B/s), 0.1 s of compute.
    # b: 100 B (1 s), 2.0 s of compute.
    graph = OpGraph([Op("a", layers=[0], time_s=0.1), Op("b", layers=[1], time_s=2.0),
                     Op("join", inputs=[0, 1], time_s=0.0)], ["a", "b"], [400, 100], "fx")
    assert graph_priorities(graph).order == (0, 1)     # a is read first
    timed = timed_priorities(graph, bandwidth=100.0)
    # Johnson: b's transfer (1 s) is shorter than the compute it unblocks (2 s),
    # a's (4 s) is longer than its 0.1 s, so b goes first: b computes 1-3 s while
    # a's parameters arrive at 5 s; the forward ends at 5.1 s instead of 7 s.
    assert timed.order == (1, 0)
    assert timed.value == (5.0, 1.0)                   # when each transfer ends
    assert timed.upper_bound_s == pytest.approx(2.1 + 5.0)  # no overlap at all
    assert timed.op_priority == {"recv:b": 0, "recv:a": 1}


class _Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(1, 2, 3)
        self.second = nn.Linear(2 * 30 * 30, 10)

    def forward(self, x):
        h = self.first(x)
        if h.sum() > -1e9:
            h = h.relu()
        return self.second(h.flatten(1))


def test_untraceable_models_fall_back_to_forward_hooks():
    model = _Branchy()
    graph = trace(model, torch.randn(2, 1, 32, 32))
    assert graph.method == "hooks"
    assert [graph.layer_names[i] for i in graph_priorities(graph).order] == ["first", "second"]


# ------------------------------------------------------ channels, routing
def test_channels_take_contiguous_priority_classes_of_equal_bytes():
    assert channel_map([(7, 10), (8, 10), (9, 20)], 2) == {7: 0, 8: 0, 9: 1}
    assert set(channel_map([(i, 5) for i in range(8)], 1).values()) == {0}
    mapping = channel_map([(i, 1) for i in range(9)], 3)
    assert [mapping[i] for i in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_routing_orders_slices_by_layer_priority_then_position():
    model = build_model("vgg_fc", in_channels=1, num_classes=10)
    plan = graph_priorities(trace(model, torch.randn(2, 1, 32, 32)))
    numels = [sum(p.numel() for p in params) for _, _, params in model_layers(model)]
    routing = build_routing(numels, plan, PSSettings(servers=2, channels=3, slice_bytes=64 * 1024))
    ordered = sorted(routing.priority, key=routing.priority.__getitem__)
    assert routing.slice(ordered[0]).layer == plan.order[0] and routing.slice(ordered[0]).part == 0
    channels = [routing.channel[sid] for sid in ordered]
    assert channels == sorted(channels) and set(channels) == {0, 1, 2}
    assert set(routing.owner) == {0, 1}


# -------------------------------------------------------------- scheduler
class _HeldSend:
    """A send whose completion (its receiver's acknowledgement) waits for ``released``."""

    def __init__(self, released: threading.Event | None):
        self.released = released

    def wait(self) -> None:
        if self.released is not None:
            assert self.released.wait(30)


@pytest.mark.timeout(60)
def test_stop_marks_never_pass_a_slice_of_their_channel_that_waits_for_credit():
    # A straggler under bounded staleness closes with its last pushes queued behind the credit window; its
    # channels' stop marks (16 bytes) fit the window. Sent first, they would end the receiver's stream and
    # leave the slices behind them unread: the sender's drain and the server's step would wait for ever.
    released = threading.Event()
    scheduler = SliceScheduler(credit_bytes=40 * 1024, acked=True, record=True)
    scheduler._issue = lambda transfer: [_HeldSend(released if transfer.payload is not None else None)]
    row = torch.zeros(16 * 1024, dtype=torch.uint8)
    scheduler.submit([Transfer(1, None, 7, slice_id, 9, row, (slice_id,)) for slice_id in range(4)])
    deadline = time.time() + 10
    while len(scheduler.issued) < 2 and time.time() < deadline:
        time.sleep(0.01)
    scheduler.submit(stop_marks(1, None, 7) + stop_marks(1, None, 8))   # channel 8 has nothing queued
    time.sleep(0.3)
    assert [t.slice_id for t in scheduler.issued] == [0, 1] + [-1] * 16   # only channel 8's stops went
    assert all(t.channel == 8 for t in scheduler.issued[2:])
    released.set()
    scheduler.close()
    on_7 = [t.slice_id for t in scheduler.issued if t.channel == 7]
    assert on_7 == [0, 1, 2, 3] + [-1] * 16


# ---------------------------------------------------------------- settings
def test_settings_resolve_per_mode_and_reject_bad_values():
    fifo = PSSettings.resolve(servers=1, priority="fifo")
    assert (fifo.channels, fifo.slice_bytes, fifo.credit_bytes) == (1, None, None)
    graph = PSSettings.resolve(servers=2, priority="graph", slice_kb=1.5)
    assert graph.slice_bytes == 1536 and graph.credit_bytes == 512 * 1024
    for kwargs, message in [({"channels": 0}, "--channels must be >= 1"), ({"slice_kb": 0}, "--slice-kb must be > 0"),
                            ({"credit_kb": -1}, "--credit-kb must be > 0"), ({"priority": "lifo"}, "choose one of")]:
        with pytest.raises(UsageError, match=message):
            PSSettings.resolve(**kwargs)
    with pytest.raises(UsageError, match="must be smaller than the number of processes"):
        PSRoles(servers=3, world_size=3)
    assert PSRoles(2, 5).workers == [2, 3, 4]
    last = PSRoles(1, 4, servers_last=True)   # hybrid: conv and FC ranks first
    assert (last.server_ranks, last.workers, last.server_index(3), last.worker_index(2)) == ([3], [0, 1, 2], 0, 2)


def test_push_rows_cover_their_width_with_fixed_slices():
    from convoy.compress import BlockTopKCompressor, IdentityCompressor
    from convoy.ps.push import RowCodec, pieces_within
    from convoy.sync import CompressionPipeline

    shapes = (torch.Size([6, 1, 5, 5]), torch.Size([6]))
    dense = RowCodec(CompressionPipeline(IdentityCompressor()))
    assert dense.row(0, 156, shapes, step=0)[0] == 8 + 4 * 156 == dense.capacity(0, 156, shapes, 0)
    sparse = RowCodec(CompressionPipeline(BlockTopKCompressor(fraction=0.1), warmup_steps=4))
    widths = [sparse.row(0, 156, shapes, step)[0] for step in range(6)]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] <= sparse.capacity(0, 156, shapes, 0)
    pieces = slice_table([sparse.capacity(0, 156, shapes, 0)], slice_bytes=64, element_size=1)[0]
    covered = pieces_within(pieces, widths[-1])
    assert sum(size for _, size in covered) == widths[-1] and len(covered) < len(pieces)


@pytest.mark.parametrize("args,expected", [
    (["--servers", "3", "--nproc", "3"], "--servers (3) must be smaller than the number of processes (3)"),
    (["--channels", "0"], "--channels must be >= 1"),
    (["--slice-kb", "0"], "--slice-kb must be > 0"),
    (["--credit-kb", "-4"], "--credit-kb must be > 0"),
    (["--priority", "lifo"], "unknown --priority 'lifo'"),
    (["--nproc", "3", "--compress", "blocktopk", "--block-selection", "global"],
     "--block-selection global needs every rank to agree"),
    (["--nproc", "4", "--servers", "2", "--checkpoint-dir", "ckpt-never-made"], "needs --servers colocated or 1"),
    (["--nproc", "3", "--parallel", "hybrid", "--conv-workers", "2", "--fc-workers", "1"],
     "needs --nproc = --conv-workers + --fc-workers + --servers = 4"),
])
def test_bad_ps_input_is_one_line_and_exit_2(args, expected, capsys):
    from convoy.cli.main import main

    assert main(["train", "--sync", "ps", *args]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("convoy: error: ") and expected in lines[0]


def test_ps_options_need_sync_ps(capsys):
    from convoy.cli.main import main

    assert main(["train", "--servers", "1"]) == 2
    assert "need --sync ps" in capsys.readouterr().err
