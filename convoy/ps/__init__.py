"""Parameter-server training with graph-derived transfer priorities (seed 004).

S server ranks hold the parameters, sharded layer by layer; W workers push each
layer's gradient the moment backward produces it and pull the updated
parameters back. Transfers are cut into slices, ordered by the priority the
next forward needs them in, and sent over several channels per server-worker pair.
"""
from convoy.ps.roles import PSRoles
from convoy.ps.settings import PRIORITY_MODES, PSSettings

__all__ = ["PRIORITY_MODES", "PSRoles", "PSSettings"]
