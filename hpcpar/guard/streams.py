"""CUDA streams and events as the transfer guard models them: ordering, not time.

Work on the guard's device runs at once (it is NumPy underneath), so the model keeps what CUDA
guarantees about order: every operation on a stream advances that stream's sequence number, and
an array remembers the stream that last wrote it and the number of that write. A reader on
another stream is ordered after the write only if

- it waited (``Stream.wait_event``) on an event recorded on the producer at or after the
  write (waits are transitive: an event carries what its stream had waited for), or
- the host synchronized the producer (``Stream.synchronize``, ``Event.synchronize``,
  ``synchronize_device``) after the write; host work issued after that is ordered after it.

``check_ready`` raises ``StreamOrderError`` otherwise, where a GPU would race. A reader outside
every stream (MPI reading device memory, the host) needs that host synchronization: ``check_synchronized``.
"""
from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field

_ids = iter(range(1, 1 << 62))
LOG_LENGTH = 100_000
_streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()  # every live stream, for synchronize_device


class StreamOrderError(RuntimeError):
    """A read that a GPU would not order after the write it depends on."""


@dataclass
class Stats:
    """What the guard counted since the last ``reset()`` (one per process)."""

    to_device: int = 0          # host -> device copies (asarray/array of host data, ndarray.set)
    to_host: int = 0            # device -> host copies (asnumpy, ndarray.get, to_host)
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    syncs: int = 0              # host waits: Stream/Event.synchronize, synchronize_device
    implicit: int = 0           # refused implicit conversions (__array__, float(), .item(), ...)
    # (direction, nbytes, "file:line in function") of the last LOG_LENGTH transfers (a long run stays small)
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOG_LENGTH))

    def reset(self) -> None:
        self.to_device = self.to_host = self.bytes_to_device = self.bytes_to_host = 0
        self.syncs = self.implicit = 0
        self.log.clear()

    def snapshot(self) -> dict:
        return {"to_device": self.to_device, "to_host": self.to_host, "bytes_to_device": self.bytes_to_device,
                "bytes_to_host": self.bytes_to_host, "syncs": self.syncs, "implicit": self.implicit}


stats = Stats()


class Stream:
    """``cupy.cuda.Stream``: ``synchronize``, ``wait_event``, ``record``, ``use``, a context manager."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.id = 0 if null else next(_ids)
        self.seq = 0            # operations issued on this stream so far
        self.host_synced = 0    # the host waited for this stream's work up to this number
        self.waited: dict[Stream, int] = {}  # producer stream -> the op number this stream waits past
        self._previous: list[Stream] = []
        _streams.add(self)

    def __repr__(self) -> str:
        return "<guard Stream null>" if self.id == 0 else f"<guard Stream {self.id}>"

    def _advance(self) -> int:
        self.seq += 1
        return self.seq

    def synchronize(self) -> None:
        """Block the host until everything issued on this stream (and what it waited for) is done."""
        stats.syncs += 1
        _host_synced(self, self.seq, self.waited)

    def wait_event(self, event: "Event") -> None:
        """Order this stream's later work after the event's (a no-op for an unrecorded event, as in CUDA)."""
        if event.stream is None:
            return
        for producer, seq in [(event.stream, event.seq), *event.waited.items()]:
            if producer is not self and self.waited.get(producer, 0) < seq:
                self.waited[producer] = seq

    def record(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def use(self) -> "Stream":
        _current.stream = self
        return self

    def __enter__(self) -> "Stream":
        self._previous.append(get_current_stream())
        return self.use()

    def __exit__(self, *exc) -> None:
        self._previous.pop().use()


Stream.null = Stream(null=True)


class Event:
    """``cupy.cuda.Event``: ``record(stream=None)`` captures the stream's progress; ``synchronize``."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.stream: Stream | None = None
        self.seq = 0
        self.waited: dict[Stream, int] = {}

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        self.stream, self.seq, self.waited = stream, stream.seq, dict(stream.waited)

    def synchronize(self) -> None:
        stats.syncs += 1
        if self.stream is not None:
            _host_synced(self.stream, self.seq, self.waited)

    @property
    def done(self) -> bool:
        return True


def _host_synced(stream: Stream, seq: int, waited: dict) -> None:
    for producer, upto in [(stream, seq), *waited.items()]:
        producer.host_synced = max(producer.host_synced, upto)


_current = threading.local()

def get_current_stream() -> Stream:
    """The calling thread's current stream (the null stream until one is made current)."""
    return getattr(_current, "stream", Stream.null)


def synchronize_device() -> None:
    """``cupy.cuda.Device().synchronize()``: the host waits for every stream."""
    stats.syncs += 1
    for stream in list(_streams):
        _host_synced(stream, stream.seq, {})


def _producer_ordered(producer: Stream, seq: int, reader: Stream | None) -> bool:
    if producer.host_synced >= seq:
        return True
    return reader is not None and (producer is reader or reader.waited.get(producer, 0) >= seq)


def check_ready(array, stream: Stream | None = None) -> None:
    """Raise ``StreamOrderError`` if ``stream`` (default: the current one) may read ``array``
    before the work that last wrote it. Host arrays and never-written arrays always pass.

    Only read-after-write is checked: write-after-read hazards (a stream overwriting what
    another still reads) are not modelled."""
    written = getattr(array, "_written", None)
    if written is None or written.stream is None:
        return
    reader = stream or get_current_stream()
    if not _producer_ordered(written.stream, written.seq, reader):
        raise StreamOrderError(
            f"{reader} reads an array that {written.stream} wrote in its op {written.seq} without being "
            f"ordered after it: record an event on the producer after the write and wait_event it on the reader, "
            f"or synchronize the producer")


def check_synchronized(array) -> None:
    """Raise unless the host synchronized the stream that last wrote ``array`` after that write
    (what MPI reading device memory, or any host code, needs)."""
    written = getattr(array, "_written", None)
    if written is not None and written.stream is not None and not _producer_ordered(written.stream, written.seq, None):
        raise StreamOrderError(
            f"device memory is read outside stream order (MPI or the host) but {written.stream} wrote it in its "
            f"op {written.seq} and was not synchronized since: synchronize that stream (or an event recorded after "
            f"the write) first")
