"""The server side of a parameter server (``ps.ParameterServer`` mixes ``ServerSide`` in): the loop
that answers the workers' pushes and pulls until every worker has stopped (``serve``), the
optimizer step on the server's range, the replies and the checkpoint a server joins.

``staleness=0`` is synchronous (one averaged step per round: data parallelism), ``staleness=s >= 1``
asynchronous with bounded staleness (each push applied as it arrives, scaled by 1/W; no worker more
than s steps ahead of the slowest): docs/architecture.md, "The parameter server". ``version``
counts the updates a server has applied; every update is logged on its server (``update_log``:
worker, step, version read, version, staleness in versions, lead in steps over the slowest worker
at read time).
"""
from __future__ import annotations

import itertools
import math
import time

import numpy as np

from ...backend import get_array_module
from ...runtime.comm import wait_all
from ...runtime.waiting import YIELD_SLEEP_S
from ...optim.clip import clip_arrays
from .protocol import (HEADER_LENGTH, KIND_PUSH, KIND_SAVE, KIND_STOP, TAG_PUSH_GRAD, TAG_PUSH_HEADER,
                          TAG_REPLY_HEADER, TAG_REPLY_PARAMS, UpdateRecord)


class ServerSide:
    """The server side of ``ParameterServer``: what server ranks run (``serve`` returns at once on a
    worker). It uses what the constructor made on a server: the shard, its optimizer, ``version``,
    ``update_log``, the communicators."""

    def serve(self) -> None:
        """On a server: answer pushes and pulls until every worker has stopped. On a worker: return."""
        if self.is_worker or self._stopped:
            return
        loop = _ServerLoop(self)
        rounds = itertools.count(1)  # a round: answer every worker whose message is there
        while loop.active:
            ready = loop.ready_workers()
            if not ready:
                loop.idle()
                continue
            with self.trace.step(next(rounds), "round"):
                for w in ready:
                    loop.take_message(w)
                loop.apply_synchronous_round()
                loop.answer_pulls()
                loop.save_when_everyone_asked()
        loop.send_final_parameters()
        self._stopped = True

    def _apply(self, grad, lr: float, contributions: list[tuple]) -> None:
        """One optimizer step on the shard with ``grad``; log one record per contributing push."""
        with self.trace.span("optimizer", "optimizer", pushes=len(contributions)):
            self._step_shard(grad, lr)
        for worker, step, version_read, lead in contributions:
            self.update_log.append(UpdateRecord(worker, step, version_read, self.version + 1,
                                                self.version - version_read, lead))
        self.version += 1

    def _step_shard(self, grad, lr: float) -> None:
        self.shard.grad = grad
        if self.max_grad_norm and self.synchronous:  # the norm of the averaged gradient over all servers
            clip_arrays([self.shard.grad], self.max_grad_norm, allreduce_sum=self._sum_over_servers)
        self.optimizer.lr = lr
        self.optimizer.step()
        self.shard.grad = None

    def _sum_over_servers(self, value: float) -> float:
        if self.server_comm.size == 1:
            return value
        return float(self.server_comm.allreduce(np.array([value]), "sum")[0])

    def _send_parameters(self, worker: int) -> list:
        version = np.array([self.version], dtype=np.int64)
        # A copy in the model's dtype: the shard changes with the next update while the send may be in flight.
        return [self.comm.isend(version, worker, TAG_REPLY_HEADER),
                self.comm.isend(self.shard.data.astype(self.params[0].dtype), worker, TAG_REPLY_PARAMS)]

    def _save_when_asked(self, saving: dict) -> None:
        steps = sorted(set(saving.values()))
        if len(steps) != 1:
            raise RuntimeError(f"parameter server {self.server_index}: workers asked to save different steps {steps}")
        if self.on_save is None:
            raise RuntimeError(f"parameter server {self.server_index}: the workers asked for a checkpoint, but "
                               f"no on_save(step) is set on the servers")
        self.on_save(steps[0])
        saving.clear()


class _ServerLoop:
    """One server's state while it serves: the messages in flight and what each worker has done.

    Each worker's next push header is always posted (``headers_in``); a push's gradient is
    received right after its header. Synchronous servers collect one gradient per active worker
    (``arrived``) before they step; asynchronous ones step on each. A pull (the worker waiting
    for parameters of its next step) is answered when the staleness bound allows.
    """

    def __init__(self, server: ServerSide):
        self.server, self.comm = server, server.comm
        workers = server.num_workers
        xp = get_array_module(server.shard.data)
        self.headers = np.zeros((workers, HEADER_LENGTH), dtype=np.float64)
        self.grads = xp.zeros((workers if server.synchronous else 1, server.shard.size), dtype=server.shard.dtype)
        self.headers_in = {w: self.comm.irecv(self.headers[w], w, TAG_PUSH_HEADER) for w in range(workers)}
        self.done = [0] * workers  # steps whose gradient this server has received, per worker
        self.lead = [0] * workers  # per worker: its lead over the slowest when it read its current parameters
        self.active = set(range(workers))
        self.waiting: dict[int, int] = {}  # worker -> the step it waits for parameters for
        self.arrived: dict[int, tuple] = {}  # synchronous: this round's pushes, worker -> (step, version read, lr)
        self.saving: dict[int, int] = {}  # workers that asked for a checkpoint -> its step
        self.sends: list = []

    def ready_workers(self) -> list[int]:
        return sorted(w for w, handle in self.headers_in.items() if handle.test())

    def idle(self) -> None:
        """Nothing arrived: free finished sends and, oversubscribed, give the core away."""
        self.sends = [h for h in self.sends if not h.test()]
        if self.comm.wait_policy == "yield":
            time.sleep(YIELD_SLEEP_S)

    def take_message(self, w: int) -> None:
        del self.headers_in[w]
        kind, step, version_read, lr = self.headers[w]
        if kind == KIND_STOP:
            self.active.discard(w)
            return
        if kind == KIND_SAVE:  # the worker now waits in the checkpoint; its next push follows it
            self.saving[w] = int(step)
        else:
            self._take_push(w, int(step), int(version_read), float(lr), applies=kind == KIND_PUSH)
        self.headers_in[w] = self.comm.irecv(self.headers[w], w, TAG_PUSH_HEADER)

    def _take_push(self, w: int, step: int, version_read: int, lr: float, applies: bool) -> None:
        server = self.server
        if step != self.done[w]:
            raise RuntimeError(f"parameter server {server.server_index}: worker {w} pushed step {step}, "
                               f"expected step {self.done[w]}")
        grad = self.grads[w] if server.synchronous else self.grads[0]
        self.comm.recv(grad, w, TAG_PUSH_GRAD)
        self.done[w] = self.waiting[w] = step + 1
        if server.synchronous:
            self.arrived[w] = (step, version_read, lr, applies)
        elif applies:  # asynchronous: a push marked non-finite is dropped alone
            grad /= server.num_workers
            server._apply(grad, lr, [(w, step, version_read, self.lead[w])])

    def apply_synchronous_round(self) -> None:
        """Once every active worker's gradient is in: their mean (in worker order), one step; no step
        when any push is marked non-finite (every server sees the same marks and skips the round)."""
        if not self.arrived or not self.active <= set(self.arrived):
            return
        if not all(applies for *_, applies in self.arrived.values()):
            self.arrived.clear()
            return
        order = sorted(self.arrived)
        mean = self.grads[order[0]].copy()
        for w in order[1:]:
            mean += self.grads[w]
        mean /= len(order)
        lr = self.arrived[order[0]][2]
        self.server._apply(mean, lr, [(w, *self.arrived[w][:2], self.lead[w]) for w in order])
        self.arrived.clear()

    def answer_pulls(self) -> None:
        """The pulls the staleness bound allows: the slowest active worker at most s steps behind."""
        slowest = min((self.done[w] for w in self.active), default=math.inf)
        for w, step in list(self.waiting.items()):
            if slowest >= step - self.server.staleness:
                self.lead[w] = step - slowest
                self.sends += self.server._send_parameters(w)
                del self.waiting[w]

    def save_when_everyone_asked(self) -> None:
        if self.saving and self.active <= set(self.saving) and not self.arrived and not self.waiting:
            self.server._save_when_asked(self.saving)

    def send_final_parameters(self) -> None:
        """Every worker stopped: all receive the final parameters."""
        for w in range(self.server.num_workers):
            self.sends += self.server._send_parameters(w)
        wait_all(self.sends)
