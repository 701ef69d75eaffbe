"""convoy: distributed training of CNNs that spends less time on the network.

The Python API in four names::

    ctx = convoy.init()                                   # process group from torchrun's env
    engine = convoy.Engine(model, torch.optim.SGD, convoy.AllReduce(), lr=0.05)
    engine.backward(loss)                                 # pipelined sync + per-layer update
    engine.synchronize()                                  # before evaluating or saving
"""
from convoy.engine import Engine, EngineError, Layer, Listener, StepStats
from convoy.errors import UsageError
from convoy.runtime import Context, init
from convoy.sync import AllReduce, SyncStrategy

__all__ = ["AllReduce", "Context", "Engine", "EngineError", "Layer", "Listener", "StepStats",
           "SyncStrategy", "UsageError", "init"]
__version__ = "0.1.0"
