"""Parameter-server training with graph-derived transfer priorities, as sync strategies.

S server ranks hold the parameters, sharded layer by layer; W workers push each
layer's (compressed) gradient as backward produces it and pull the updated
parameters back. Both sides run the one engine (:mod:`convoy.engine`): a
worker's exchange stage is :class:`~convoy.ps.worker.PushPull`, a server's is
:class:`~convoy.ps.server.ServeShard`, whose engine updates the server's shard.
Transfers are cut into slices, ordered by the priority the next forward needs
them in, held within a credit window and sent over several channels per
server-worker pair.
"""
from convoy.ps.roles import PSRoles
from convoy.ps.settings import PRIORITY_MODES, PSSettings

__all__ = ["PRIORITY_MODES", "PSRoles", "PSSettings"]
