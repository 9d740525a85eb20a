"""A gradient compressor's error feedback in checkpoints, so that a compressed run resumes exactly.

Top-k's residuals and PowerSGD's errors and Q factors are this rank's own: each dp replica
carries its own from step to step. They are saved as this rank's row of a tensor per state
array, ``compression/<compressor>/<name>/<D>x<P>x<T>.pp<p>.tp<t>/<shape>`` of global shape
(D, *shape): the layout dp x pp x tp and this rank's place in it. A load takes this rank's rows
back only when the checkpoint holds, under its layout and place, exactly the names and shapes
its compressor will carry for its own buckets (``Compressor.state_shapes``): in the same layout
it reads exactly its row back (then bitwise the uninterrupted run); in another layout, or with
other buckets (another ``bucket_mb``, another partition), its compressor starts afresh, which the
load logs. With ``saved=False`` (``checkpoint.compression_state = false``: the state is about one
float32 copy of the gradients per dp replica) checkpoints leave it out, and every load starts it
afresh and logs that. State in bfloat16 (top-k's residuals under bf16), which HDF5 cannot store,
is saved as float32 (exactly), with a scalar ``<key>/bfloat16`` that has it read back into bfloat16.
"""
from __future__ import annotations

import numpy as np

from .. import log
from ..backend import to_device
from ..optim import precision_dtype
from ..state import Checkpointable, LoadPlan, Piece, Read, row_of

logger = log.get_logger(__name__)
PREFIX = "compression"
BFLOAT16 = "/bfloat16"  # a scalar under a state's key: the state was bfloat16, saved as float32


class CompressionState(Checkpointable):
    """The state ``compressor.state_arrays()`` gives, on the dp, pp and tp ranks of ``ctx``, for the
    ``buckets`` of the DDP the compressor reduces; ``saved=False``: checkpoints leave it out."""

    def __init__(self, compressor, ctx, buckets, saved: bool = True):
        self.compressor, self.ctx, self.saved = compressor, ctx, saved
        self.expected = compressor.state_shapes(buckets)
        self.place = f"{ctx.dp_size}x{ctx.pp_size}x{ctx.tp_size}.pp{ctx.pp_rank}.tp{ctx.tp_rank}"

    def _key(self, name: str, shape: tuple) -> str:
        return f"{PREFIX}/{self.compressor.name}/{name}/{self.place}/{'x'.join(map(str, shape))}"

    def _row(self, shape: tuple) -> tuple:
        return row_of(self.ctx.dp_size, self.ctx.dp_rank, shape)

    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        pieces, widened = [], {}
        for name, values in sorted(self.compressor.state_arrays().items()) if self.saved else ():
            shape = tuple(values.shape)
            key = self._key(name, shape)
            if values.dtype.name == "bfloat16":  # HDF5 has no such type: as float32 (exactly), marked
                values, widened[key + BFLOAT16] = values.astype(np.float32), 1
            pieces.append(Piece(key, *self._row(shape), values.reshape((1,) + shape)))
        return pieces, widened

    def load_plan(self, saved) -> LoadPlan:
        """Read this rank's rows when the checkpoint has exactly the state this rank's compressor
        carries (names and shapes); the compressor's state is replaced once the load commits (by
        nothing, when the checkpoint has none that fits)."""
        mine = f"/{self.place}/"
        prefix = f"{PREFIX}/{self.compressor.name}/"
        found = {}
        for key in saved.tensor_keys:
            if key.startswith(prefix) and mine in key:
                name, _, shape_text = key[len(prefix):].partition(mine)
                found[name] = tuple(int(n) for n in shape_text.split("x"))
        staged, reads = {}, []
        for name, shape in sorted(found.items()) if self.saved and found == self.expected else ():
            key = self._key(name, shape)

            def assign(values, name=name, shape=shape, narrow=key + BFLOAT16 in saved.scalars):
                values = values.reshape(shape)
                staged[name] = to_device(values.astype(precision_dtype("bf16")) if narrow else values, self.ctx.xp)
            reads.append(Read(key, *self._row(shape), assign))
        missing = None
        if not self.saved:
            missing = "is not kept in checkpoints (checkpoint.compression_state = false)"
        elif found != self.expected:
            missing = ("was saved in another layout or with other buckets"
                       if any(key.startswith(f"{PREFIX}/") for key in saved.tensor_keys) else
                       "is not in the checkpoint (a run without compression, or an hpcpar from before it was kept)")

        def finish():
            if missing:
                logger.warning(f"{self.compressor.name}'s error feedback {missing}: it starts afresh here, so this "
                               f"run is not bitwise the one it continues")
            self.compressor.load_state_arrays(staged)
        return LoadPlan(reads, [finish])
