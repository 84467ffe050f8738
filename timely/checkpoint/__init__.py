"""Checkpoints, recovery and rescaling (``from timely import checkpoint``).

A job run with checkpoints (``python -m timely.launch --checkpoint DIR --checkpoint-every N``,
``timely.execute(..., checkpoint=DIR, checkpoint_every=N)``) gets a :class:`Checkpointer` as
``worker.checkpoint`` (``None`` without checkpoints). Stateful operators register as participants
and offer their changed state at every checkpoint epoch; :func:`source` replays the input from the
checkpoint's epoch after a restart, and :func:`sink` writes every epoch's output once.
:class:`Store` is the storage layout (fsspec: a directory or any fsspec URL).
"""
from __future__ import annotations

from .checkpointer import CheckpointConfig, Checkpointer, Participant
from .sources import read_sink, sink, source
from .store import CheckpointError, Manifest, Store

__all__ = ["CheckpointConfig", "CheckpointError", "Checkpointer", "Manifest", "Participant", "Store", "read_sink",
           "sink", "source"]
