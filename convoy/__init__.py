"""convoy: distributed training of CNNs that spends less time on the network.

The Python API in five names::

    ctx = convoy.init()                                   # process group from torchrun's env
    engine = convoy.Engine(model, torch.optim.SGD, convoy.AllReduce(), lr=0.05)
    engine.backward(loss)                                 # pipelined sync + per-layer update
    engine.synchronize()                                  # before evaluating or saving
    convoy.shutdown()                                     # every rank done: leave the process group

and, for an existing DDP job, convoy's compressors as a comm hook::

    ddp_model.register_comm_hook(*convoy.ddp.comm_hook("blocktopk", block_fraction=0.01))
"""
from convoy import ddp
from convoy.engine import Engine, EngineError, Layer, Listener, StepStats
from convoy.errors import UsageError
from convoy.runtime import Context, init, shutdown
from convoy.sync import AllReduce, SyncStrategy

__all__ = ["AllReduce", "Context", "Engine", "EngineError", "Layer", "Listener", "StepStats",
           "SyncStrategy", "UsageError", "ddp", "init", "shutdown"]
__version__ = "0.1.0"
