"""Layer-wise pipelined checkpoints into a memory-mapped (persistent-memory) file.

- :mod:`~convoy.checkpoint.format`: the layout, fixed offsets, commit records.
- :mod:`~convoy.checkpoint.store`: the mapped file with two areas, msync.
- :mod:`~convoy.checkpoint.listener`: snapshot each layer when updated; :mod:`~convoy.checkpoint.schedule`:
  when, and which kind; :mod:`~convoy.checkpoint.persister`: write in the background.
- :mod:`~convoy.checkpoint.recovery`: newest valid area, checksums, restore.
- :mod:`~convoy.checkpoint.session`: resume-or-start for a training job.
- :mod:`~convoy.checkpoint.export`, :mod:`~convoy.checkpoint.inspect`: plain torch files, descriptions.
- :mod:`~convoy.checkpoint.written`, :mod:`~convoy.checkpoint.deal`, :mod:`~convoy.checkpoint.reshard`,
  :mod:`~convoy.checkpoint.relayout`: a resume on another number of workers (read, re-deal, stage, commit).
"""
from convoy.checkpoint.export import export_checkpoint, load_initial_state
from convoy.checkpoint.format import FormatError
from convoy.checkpoint.listener import CheckpointListener
from convoy.checkpoint.persister import CheckpointError, CheckpointFiles
from convoy.checkpoint.session import CheckpointSettings, ResumePoint, start_checkpointing

__all__ = ["CheckpointError", "CheckpointFiles", "CheckpointListener", "CheckpointSettings", "FormatError", "ResumePoint",
           "export_checkpoint", "load_initial_state", "start_checkpointing"]
