"""Local SGD's replicas in checkpoints, so that a local SGD run resumes exactly wherever it stopped.

Between averages every dp replica holds parameters of its own; without
``average_optimizer_state`` its optimizer state is its own at every step, and under a dynamic
loss scaler (fp16) so is its scale, since each replica skips its own overflowing steps. A
checkpoint's ``model/`` and ``optim/`` tensors hold one model, the average (a periodic
checkpoint between averages saves the replicas' mean and leaves them as they are; a run that
ends between averages averages first), and one replica's optimizer state. So each replica also
saves what is its own as its row of a tensor of global shape (D, ...), D the number of replicas
(``LocalSGDReplicas.checkpoint_pieces``). A run that resumes with D replicas takes its own rows
back after the rest of the load, and its count of steps to the next average: it is then the
uninterrupted run, bit for bit. With another number of replicas it starts from the average, one
replica's optimizer state and a fresh count (which the load logs). A single replica saves no
rows: it is the model.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import log
from ..backend import to_device
from ..state import Checkpointable, LoadPlan, Piece, Read, row_of

logger = log.get_logger(__name__)
PREFIX = "local_sgd"
COUNT = "steps_since_average"


class LocalSGDReplicas(Checkpointable):
    """This dp replica's own values of a ``LocalSGD`` (its parameters, optimizer state and
    ``scaler``, a ``DynamicLossScaler`` or None) as rows of checkpoint tensors."""

    def __init__(self, local, ctx, scaler=None):
        self.local, self.ctx, self.scaler = local, ctx, scaler
        self.prefix = f"{PREFIX}/{ctx.dp_size}/"
        self.held = None  # (count, parameters, state): this replica's values before an average that ends the run

    def hold(self) -> None:
        """Keep copies of this replica's parameters and optimizer state before an average that ends
        the run between averages: the checkpoint saved after that average holds them as rows."""
        self.held = (self.local.steps_since_average, [p.data.copy() for p in self._params()], self._state(copy=True))

    def release(self) -> None:
        self.held = None

    def _params(self) -> list:
        return self.local.optimizer.params  # what steps and is averaged (the masters), in the names' order

    def _state(self, copy: bool = False) -> list:
        """[(parameter name, state key, value)] of the optimizer, in a fixed order."""
        state = self.local.optimizer.state
        return [(name, key, value.copy() if copy and np.ndim(value) else value)
                for name in self.local.optimizer.names for key, value in sorted(state.get(name, {}).items())]

    def _row(self, what: str, values) -> Piece:
        values = values if np.ndim(values) else np.array([int(values)], dtype=np.int64)  # a count: a row of one
        shape = tuple(values.shape)
        return Piece(self.prefix + what, *row_of(self.ctx.dp_size, self.ctx.dp_rank, shape), values.reshape((1,) + shape))

    def checkpoint_pieces(self) -> tuple[list[Piece], dict]:
        """This replica's rows (a single replica saves none, only the count), D the number of replicas:

        - ``local_sgd/<D>/param/<name>``: its parameters (the masters under mixed precision), when
          the checkpoint is taken between averages (periodic, or at the end of a run that stops
          there: a signal, ``train.max_seconds``, a last step that is not a multiple of H, whose
          rows are its values from before that last average);
        - ``local_sgd/<D>/optim/<name>/<key>``: its optimizer state, when that is its own (not
          averaged, or taken between averages); an integer count is a row of one;
        - ``local_sgd/<D>/scaler``: its loss scale and clean-step count, under a dynamic loss scaler;
        - the scalar ``local_sgd/<D>/steps_since_average``.
        """
        count = self.local.steps_since_average
        count, params, state = self.held or (count, [p.data for p in self._params()] if count else None, self._state())
        pieces = []
        if self.ctx.dp_size > 1:
            names = self.local.optimizer.names
            pieces += [self._row(f"param/{name}", values) for name, values in zip(names, params or ())]
            if count or not self.local.average_optimizer_state:
                pieces += [self._row(f"optim/{name}/{key}", value) for name, key, value in state]
            if self.scaler is not None:
                pieces.append(self._row("scaler", np.array([self.scaler.scale, self.scaler.clean_steps])))
        return pieces, {self.prefix + COUNT: count}

    def load_plan(self, saved) -> LoadPlan:
        """This replica's rows, put in after the rest of the load (the average, one replica's
        state); without rows for this number of replicas, a fresh count to the next average."""
        count = saved.scalars.get(self.prefix + COUNT)
        if count is None:
            others = sorted(int(k.split("/")[1]) for k in saved.scalars
                            if k.startswith(PREFIX + "/") and k.endswith("/" + COUNT))
            return LoadPlan([], [lambda: self._start_afresh(others)])
        staged, reads = [], []

        def read(what: str, shape: tuple, put) -> None:
            """A read of this replica's row of ``what`` when the checkpoint has it; ``put(values)`` at finish."""
            key = self.prefix + what
            if key in saved.tensor_keys:
                reads.append(Read(key, *row_of(self.ctx.dp_size, self.ctx.dp_rank, shape),
                                  lambda values: staged.append((put, values.reshape(shape)))))
        optimizer = self.local.optimizer
        for name, param in zip(optimizer.names, self._params()):
            read(f"param/{name}", tuple(param.shape), functools.partial(put_parameter, param))
            for key in saved.state_keys(name):
                count_key = f"optim/{name}/{key}" in saved.scalars
                read(f"optim/{name}/{key}", (1,) if count_key else tuple(param.shape),
                     functools.partial(put_state, optimizer.state, name, key, None if count_key else param))
        if self.scaler is not None:
            read("scaler", (2,), self._put_scale)

        def finish():  # after the optimizer's own finish: these values win
            for put, values in staged:
                put(values)
            self.local.steps_since_average = int(count)
        return LoadPlan(reads, [finish])

    def _put_scale(self, values) -> None:
        self.scaler.scale, self.scaler.clean_steps = float(values[0]), int(values[1])

    def _start_afresh(self, others: list) -> None:
        self.local.steps_since_average = 0
        if others and self.ctx.rank == 0:
            logger.info(f"local SGD: the checkpoint's replicas were saved at dp = {', '.join(map(str, others))}, "
                        f"this run has dp = {self.ctx.dp_size}: every replica starts from their average, with "
                        f"one replica's optimizer state, and averages {self.local.local_steps} steps from here")


def put_parameter(param, values) -> None:
    param.data[...] = to_device(values, param.xp)


def put_state(state: dict, name: str, key: str, param, values) -> None:
    """This replica's optimizer state ``key`` of parameter ``name``: an integer count when
    ``param`` is None, else an array like the parameter."""
    state.setdefault(name, {})[key] = int(values[0]) if param is None else \
        to_device(values, param.xp).astype(param.dtype, copy=False)
