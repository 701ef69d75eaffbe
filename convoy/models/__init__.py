"""Built-in CNNs, user model factories, and the conv/FC split used by hybrid training."""
from convoy.models.registry import MODEL_NAMES, build_model
from convoy.models.split import split_point

__all__ = ["MODEL_NAMES", "build_model", "split_point"]
