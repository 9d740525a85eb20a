"""The stage channel: activations and gradients between pipeline stages, for training and inference.

A channel is one direction between two neighbouring stages (activations forward, gradients
back); its tag ``4 * sending_stage + 2 * is_header + is_gradient`` names it, so MPI's
non-overtaking rule pairs messages in order. An activation's shape is agreed once per channel
by a small header (dtype and shape) before the first message; ``new_shapes`` starts a new
agreement (the next step, or the next inference batch, may change the batch size or sequence
length). A gradient has the shape of the activation it answers, which the receiver sent itself.
"""
from __future__ import annotations

import numpy as np

HEADER_LEN = 8  # dtype code, ndim, up to six dimensions
WIRE_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16"]


def _wire_dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # NumPy knows it only through ml_dtypes
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _channel_tag(sending_stage: int, gradient: bool, header: bool = False) -> int:
    return 4 * sending_stage + (1 if gradient else 0) + (2 if header else 0)


class StageChannel:
    """Sends (non-blocking, kept until complete), receives and headers between this rank's
    stages and their neighbours on ``comm`` (the pp communicator); made per step or per ``infer``."""

    def __init__(self, comm, rank_of, wire_dtype=None):
        self.comm, self.rank_of, self.wire_dtype = comm, rank_of, wire_dtype
        self.sends: list = []
        self.new_shapes()

    def new_shapes(self) -> None:
        self.agreed: dict = {}  # incoming activation channel (sending stage) -> (shape, dtype)
        self.announced: set = set()  # outgoing activation channels whose header went out

    def send(self, array, to_stage: int, from_stage: int, gradient: bool) -> None:
        """Post ``array`` to ``to_stage``; an activation channel's first message is preceded by its header."""
        wire = array.astype(self.wire_dtype) if self.wire_dtype is not None else array
        if not gradient and from_stage not in self.announced:
            self.announced.add(from_stage)
            header = np.zeros(HEADER_LEN, dtype=np.int64)
            header[0], header[1] = WIRE_DTYPES.index(str(array.dtype)), array.ndim
            header[2: 2 + array.ndim] = array.shape
            self.sends.append(self.comm.isend(header, self.rank_of(to_stage), _channel_tag(from_stage, False, True)))
        self.sends.append(self.comm.isend(wire, self.rank_of(to_stage), _channel_tag(from_stage, gradient)))

    def activation_shape(self, from_stage: int) -> tuple:
        """(shape, dtype) of the activations from ``from_stage``: its header, received once per agreement."""
        if from_stage not in self.agreed:
            header = np.empty(HEADER_LEN, dtype=np.int64)
            self.comm.recv(header, self.rank_of(from_stage), _channel_tag(from_stage, False, True))
            self.agreed[from_stage] = (tuple(int(d) for d in header[2: 2 + header[1]]),
                                       _wire_dtype(WIRE_DTYPES[header[0]]))
        return self.agreed[from_stage]

    def post_recv(self, from_stage: int, gradient: bool, shape, dtype, xp) -> tuple:
        """(handle, dtype): a posted receive and the dtype its array is cast to once waited for."""
        buf = xp.empty(shape, dtype=self.wire_dtype or dtype)
        return self.comm.irecv(buf, self.rank_of(from_stage), _channel_tag(from_stage, gradient)), dtype

    def receive(self, from_stage: int, xp):
        """The next activation from ``from_stage``, blocking (inference)."""
        shape, dtype = self.activation_shape(from_stage)
        buf = xp.empty(shape, dtype=self.wire_dtype or dtype)
        return self.comm.recv(buf, self.rank_of(from_stage), _channel_tag(from_stage, False)).astype(dtype, copy=False)

    def release_sent(self, start_queued: bool = False) -> None:
        """Forget the sends that have completed, so that their buffers (a gradient no one else
        holds, a cast copy for the wire) are freed now rather than at the end of the step. With
        ``start_queued`` False it only looks: a send an NCCL communicator still queues stays for its group."""
        self.sends = [h for h in self.sends if not h.test(start_queued=start_queued)]

    def wait_sent(self) -> None:
        for handle in self.sends:
            handle.wait()
        self.sends = []
