"""Sharded HDF5 checkpoints: parallel writes, a global view plain h5py reads, atomic commit,
verified loads into any layout, exact resume. See writer.py and reader.py."""
from .reader import load, load_latest
from .manifest import CheckpointDamaged, CheckpointError, NonFiniteCheckpoint, latest_step, list_steps, read_manifest
from .async_save import wait
from .writer import save

__all__ = ["CheckpointDamaged", "CheckpointError", "NonFiniteCheckpoint", "latest_step", "list_steps", "load", "load_latest", "read_manifest", "save", "wait"]
