"""What the engine and the sync strategies share: the exchange interface, listeners, step
accounting and the one wait/poll helper. Depends on nothing else in convoy, so the engine
and every strategy (all-reduce, hierarchical, the parameter server) import it one way."""
from convoy.core.listeners import Listener
from convoy.core.stats import StepStats
from convoy.core.sync import Done, PendingSync, Replay, SyncStrategy, Trace
from convoy.core.waiting import POLL_S, Waiter, wait_until

__all__ = ["POLL_S", "Done", "Listener", "PendingSync", "Replay", "StepStats", "SyncStrategy", "Trace", "Waiter",
           "wait_until"]
