"""The layer-wise pipelined engine and its plug points."""
from convoy.engine.engine import Engine, EngineError
from convoy.engine.layers import Layer
from convoy.engine.listeners import Listener
from convoy.engine.stats import StepStats

__all__ = ["Engine", "EngineError", "Layer", "Listener", "StepStats"]
