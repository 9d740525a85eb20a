"""The transfer guard: hpcpar's CuPy path, run on CPUs, with every host<->device copy counted.

Device ``"guard"`` (``init(device="guard")``, ``train.device = "guard"``, or
``HPCPAR_DEVICE=guard`` where the device is ``"auto"``) makes ``backend.array_module`` return
``hpcpar.guard.xp``: CuPy's API, only the part hpcpar uses, over NumPy memory. Its arrays
(``guard.ndarray``) refuse implicit conversion to the host (``__array__``, ``float()``,
``int()``, ``bool()``, ``.item()``, ``.tolist()``, NumPy functions) with
``TransferGuardError``, counted in ``stats.implicit`` even where the error is caught; the
explicit copies (``asnumpy``/``.get()``, ``asarray`` of host data/``.set()``) are counted with
their bytes and call sites in ``stats``. Streams and events model CUDA's ordering (``streams``):
every array remembers the stream that last wrote it, and reading it from a stream not ordered
after that write raises ``StreamOrderError``. Like JAX's transfer guard, for tests and for users
who want the check; nothing here imports the rest of hpcpar.
"""
from .array import TransferGuardError, ndarray
from .streams import (Event, Stats, Stream, StreamOrderError, check_ready, check_synchronized, get_current_stream,
                      stats, synchronize_device)
from . import xp

asnumpy = xp.asnumpy

__all__ = ["Event", "Stats", "Stream", "StreamOrderError", "TransferGuardError", "asnumpy", "check_ready",
           "check_synchronized", "get_current_stream", "ndarray", "stats", "synchronize_device", "xp"]
