"""convoy: distributed training of CNNs that spends less time on the network.

The Python API in five names::

    ctx = convoy.init()                                   # process group from torchrun's env
    engine = convoy.Engine(model, torch.optim.SGD, convoy.AllReduce(), lr=0.05)
    engine.backward(loss)                                 # pipelined sync + per-layer update
    engine.synchronize()                                  # before evaluating or saving
    convoy.shutdown()                                     # every rank done: leave the process group
"""
from convoy.engine import Engine, EngineError, Layer, Listener, StepStats
from convoy.errors import UsageError
from convoy.runtime import Context, init, shutdown
from convoy.sync import AllReduce, SyncStrategy

__all__ = ["AllReduce", "Context", "Engine", "EngineError", "Layer", "Listener", "StepStats",
           "SyncStrategy", "UsageError", "init", "shutdown"]
__version__ = "0.1.0"
