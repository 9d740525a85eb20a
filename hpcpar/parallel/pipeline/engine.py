"""The pipeline engine: executes a schedule's actions on this rank's stages.

    ctx = hpcpar.init(pp=4)
    pipe = PipelineParallel(GPT(config), ctx, schedule="1f1b", micro_batches=8)  # loss: model.loss_from_logits
    optimizer = AdamW(pipe.named_parameters(), lr=3e-4)
    loss = pipe.train_step(ids, targets)      # the same mean loss on every pipeline rank
    optimizer.step(); optimizer.zero_grad()

Every rank builds the whole model (same seed, same values) and keeps the layers of its
virtual stages ``r, r + p, ...``. ``train_step`` splits the batch into micro-batches and runs
the schedule (``schedules.py``: GPipe, 1F1B, interleaved, and ZB-H1, whose B actions leave
the weight gradients to later W actions: ``autograd.deferred``) under its execution contract:
sends are non-blocking, forgotten after any action once complete (``_release_sent``: their
buffers go back then) and the rest waited for at the end of the step, a receive is posted at its
RECV action and waited for by the compute that needs it. The tag names the channel
(``4 * sending_stage + 2 * is_header + is_gradient``: ``_channel_tag``), so MPI's
non-overtaking rule pairs messages in order.

Activation shapes are agreed once per step and channel: micro-batch 0's activation is
preceded by a small header (dtype and shape), and every micro-batch of a step has that shape;
the next step may change batch size or sequence length. Gradients have the shape of the
activation they answer, which the receiving side sent itself.

After the schedule: gradients of weights held by several stages (the GPT's tied input/output
embedding) are summed between those ranks, then averaged over the dp group.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from ... import defaults
from ...autograd import Tensor, no_grad
from ...autograd.deferred import deferred_weight_grads
from ...backend import get_array_module
from ...runtime.trace import Tracer
from ...nn.dropout_keys import offset_dropout_key
from ...state import ParameterHolder
from ..data import DistributedDataParallel
from ..sequence import sync_sequence_parallel_grads
from .partition import partition as partition_layers
from .schedules import make_schedule, theoretical_bubble

HEADER_LEN = 8  # dtype code, ndim, up to six dimensions
WIRE_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16"]


def _wire_dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # NumPy knows it only through ml_dtypes
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _channel_tag(sending_stage: int, gradient: bool, header: bool = False) -> int:
    return 4 * sending_stage + (1 if gradient else 0) + (2 if header else 0)


class PipelineParallel(ParameterHolder):
    def __init__(self, model, ctx, schedule: str = defaults.PIPELINE_SCHEDULE, micro_batches: int = defaults.MICRO_BATCHES,
                 loss_fn=None, partition="uniform", chunks: int = defaults.CHUNKS, sample_input=None, wire_dtype=None,
                 bucket_mb: float = defaults.BUCKET_MB,
                 dp_average: bool = True, backward_loss=None, compression=None):
        """``dp_average=False`` leaves the dp reduction of gradients to the optimizer (ZeRO-1);
        ``backward_loss(loss)`` runs the last stage's backward (mixed precision: ``amp.backward``,
        which seeds it with the loss scale); ``compression``, a compressor of
        ``parallel.compression``, runs in the dp all-reduce of the buckets (at dp = 1 too: it
        changes the gradient)."""
        loss_fn = loss_fn or getattr(model, "loss_from_logits", None)
        if loss_fn is None:
            raise ValueError("PipelineParallel needs loss_fn(output, targets) for the last stage")
        layers = list(model.layers()) if hasattr(model, "layers") else list(model)
        names = ({id(p): n for n, p in model.named_parameters()} if hasattr(model, "named_parameters")
                 else {id(p): f"layers.{i}.{n}" for i, layer in enumerate(layers) for n, p in _named(layer)})
        self.ctx, self.comm = ctx, ctx.pp
        self.p, self.v, self.m = ctx.pp_size, chunks, micro_batches
        self.num_virtual = self.p * chunks
        self.loss_fn = loss_fn
        self.backward_loss = backward_loss or (lambda loss: loss.backward())
        self.wire_dtype = np.dtype(wire_dtype) if wire_dtype is not None else None
        self.schedule_name = schedule
        self.actions = make_schedule(schedule, self.p, micro_batches, chunks)[ctx.pp_rank]
        self.split_backward = any(a.kind == "W" for a in self.actions)  # zero bubble: B and W apart
        self.bounds = partition_layers(layers, self.num_virtual, partition, sample_input,
                                       agree=lambda costs: ctx.world.bcast_object(costs, root=0))
        self.stage_layers = {s: layers[self.bounds[s]: self.bounds[s + 1]]
                             for s in range(self.num_virtual) if s % self.p == ctx.pp_rank}

        # Which ranks hold each parameter: a weight on several ranks (tied) has its gradient summed.
        holders: dict[int, set] = {}
        for s in range(self.num_virtual):
            for layer in layers[self.bounds[s]: self.bounds[s + 1]]:
                for _, param in _named(layer):
                    holders.setdefault(id(param), set()).add(s % self.p)
        self._named = []
        seen = set()
        for s in sorted(self.stage_layers):
            for layer in self.stage_layers[s]:
                for _, param in _named(layer):
                    if id(param) not in seen:
                        seen.add(id(param))
                        self._named.append((names[id(param)], param))
        self._tied = self._tied_groups(layers, holders, names)
        # A compressor sees a bucket whole (top-k ranks its entries, PowerSGD factors its matrices):
        # a tied weight alone in its bucket is compressed alike by each holder, so the copies agree.
        tied = [p for _, _, params in self._tied for p in params] if compression is not None else []
        self.ddp = (DistributedDataParallel(self, ctx, bucket_mb=bucket_mb, overlap=False, compression=compression,
                                            alone=tied)
                    if dp_average and (ctx.dp_size > 1 or compression is not None) else None)
        self.stats: dict = {}
        self.trace: list = []

    # ----- parameters -----------------------------------------------------------------
    def named_parameters(self):
        """This rank's parameters under their names in the whole model (tied ones on each holder)."""
        return list(self._named)

    def parameters(self):
        return [p for _, p in self._named]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def _tied_groups(self, layers, holders, names) -> list:
        """[(communicator over the holders, [params])] for weights held by several pipeline ranks."""
        groups: dict[tuple, list] = {}
        for name_id, ranks in holders.items():
            if len(ranks) > 1:
                groups.setdefault(tuple(sorted(ranks)), []).append(name_id)
        mine = {id(p): p for _, p in self._named}
        tied = []
        for ranks in sorted(groups):  # the same order on every rank: Split is collective over pp
            member = self.ctx.pp_rank in ranks
            # The pp communicator's kind (MPI or NCCL); the context frees it when it is closed.
            comm = self.ctx.adopt(self.comm.split(0 if member else None, self.ctx.pp_rank, "pp-tied"))
            if member:
                params = sorted((mine[i] for i in groups[ranks]), key=lambda p: names[id(p)])
                tied.append((comm, ranks, params))
        return tied

    def owns_for_norm(self, param) -> bool:
        """Whether this rank counts ``param`` in a global norm (tied weights: the lowest holder)."""
        return all(param not in params or self.ctx.pp_rank == ranks[0] for _, ranks, params in self._tied)

    # ----- transport ------------------------------------------------------------------
    def _rank_of(self, stage: int) -> int:
        return stage % self.p

    def _post_send(self, array, to_stage: int, from_stage: int, gradient: bool, with_header: bool) -> None:
        wire = array.astype(self.wire_dtype) if self.wire_dtype is not None else array
        if with_header:
            header = np.zeros(HEADER_LEN, dtype=np.int64)
            header[0], header[1] = WIRE_DTYPES.index(str(array.dtype)), array.ndim
            header[2: 2 + array.ndim] = array.shape
            self._sends.append(self.comm.isend(header, self._rank_of(to_stage), _channel_tag(from_stage, gradient, True)))
        self._sends.append(self.comm.isend(wire, self._rank_of(to_stage), _channel_tag(from_stage, gradient)))

    def _post_recv(self, from_stage: int, gradient: bool, shape, dtype, xp):
        wire_dtype = self.wire_dtype or dtype
        buf = xp.empty(shape, dtype=wire_dtype)
        handle = self.comm.irecv(buf, self._rank_of(from_stage), _channel_tag(from_stage, gradient))
        return handle, dtype

    def _release_sent(self) -> None:
        """Forget the sends that have completed, so that their buffers (a gradient no one else
        holds, a cast copy for the wire) are freed now rather than at the end of the step. Only
        looks: a send an NCCL communicator still queues stays for its group."""
        self._sends = [h for h in self._sends if not h.test(start_queued=False)]

    def _recv_header(self, from_stage: int):
        header = np.empty(HEADER_LEN, dtype=np.int64)
        self.comm.recv(header, self._rank_of(from_stage), _channel_tag(from_stage, False, True))
        return tuple(int(d) for d in header[2: 2 + header[1]]), _wire_dtype(WIRE_DTYPES[header[0]])

    def _take(self, key):
        """Wait for the receive feeding ``key`` (timed as idle: the bubble) and return the array."""
        handle, dtype = self._recvs.pop(key)
        start = time.perf_counter()
        array = handle.wait()
        self._idle += time.perf_counter() - start
        return array.astype(dtype, copy=False)

    # ----- one training step --------------------------------------------------------
    def train_step(self, inputs, targets):
        """Forward and backward of the whole batch through the pipeline; returns the mean loss, a
        0-d array on the device (the same on every pipeline rank).

        ``inputs`` matter on the first stage and ``targets`` on the last (others may pass None).
        Gradients are left in the parameters (summed over micro-batches, averaged over dp).
        """
        first, last = self.ctx.is_first_stage, self.ctx.is_last_stage
        self._inputs = _split(inputs, self.m, "inputs") if first else None
        self._targets = _split(targets, self.m, "targets") if last else None
        self._saved: dict = {}  # (micro-batch, stage) -> (input Tensor, output Tensor or loss)
        self._weights: dict = {}  # (micro-batch, stage) -> weight gradients its W computes (zb1)
        self._handover: dict = {}  # p == 1: tensors passed between stages in memory
        self._recvs: dict = {}
        self._sends: list = []
        self._recv_shape: dict = {}  # per incoming channel: (shape, dtype) agreed for this step
        self._header_sent: set = set()  # outgoing channels whose header went out this step
        self._idle, self._loss, peak = 0.0, 0.0, 0
        by_kind = {kind: 0.0 for kind in ("F", "B", "W")}  # compute seconds per action kind
        self.trace = []
        pp_seconds_before = self.ctx.pp.stats.total_seconds
        step_start = time.perf_counter()

        context = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
        with context:
            for action in self.actions:
                start, idle_before = time.perf_counter(), self._idle
                getattr(self, "_do_" + action.kind)(action)
                end = time.perf_counter()
                if action.kind in ("F", "B", "W"):  # less the wait for its input, which is idle time
                    by_kind[action.kind] += end - start - (self._idle - idle_before)
                self.trace.append((str(action), start, end))
                peak = max(peak, len(self._saved))
                self._release_sent()
        compute = sum(by_kind.values())
        send_wait = time.perf_counter()
        for handle in self._sends:
            handle.wait()
        self._sends = []
        comm_start = time.perf_counter()
        self._sum_tied_gradients()
        if self.ddp is not None:
            self.ddp.finish_grad_sync()
        sync_sequence_parallel_grads(self._named, self.ctx.tp)
        loss = self._share_loss()
        end = time.perf_counter()
        self.trace.append(("SYNC", comm_start, end))
        step = end - step_start
        p2p_seconds = self.ctx.pp.stats.total_seconds - pp_seconds_before
        communication = (end - comm_start) + (comm_start - send_wait) + p2p_seconds - self._idle
        self.stats = {"step_s": step, "compute_s": compute, "idle_s": self._idle,
                      "comm_s": max(0.0, communication), "bubble": self._idle / step if step else 0.0,
                      "theoretical_bubble": theoretical_bubble(self.p, self.m, self.v),
                      "peak_activations": peak, "step_start": step_start, "compute_by_kind": by_kind}
        return loss

    def _do_RECV_F(self, a):
        channel = a.peer_stage
        if channel not in self._recv_shape:  # the per-step handshake on micro-batch 0
            start = time.perf_counter()
            self._recv_shape[channel] = self._recv_header(channel)
            self._idle += time.perf_counter() - start  # waiting for the previous stage: the bubble
        shape, dtype = self._recv_shape[channel]
        self._recvs[("F", a.microbatch, a.stage)] = self._post_recv(channel, False, shape, dtype, self._xp())

    def _do_RECV_B(self, a):
        output = self._saved[(a.microbatch, a.stage)][1]
        self._recvs[("B", a.microbatch, a.stage)] = self._post_recv(a.peer_stage, True, output.shape,
                                                                    output.dtype, output.xp)

    def _do_F(self, a):
        i, s = a.microbatch, a.stage
        if s == 0:
            x = self._inputs[i]
        elif ("F", i, s) in self._recvs:
            x = Tensor(self._take(("F", i, s)), requires_grad=True)
        else:  # p == 1: the previous stage is on this rank
            x = Tensor(self._handover.pop(("F", i, s)).data, requires_grad=True)
        out = x
        with offset_dropout_key(i * x.shape[0]):  # micro-batch i's rows: the masks one process draws for them
            for layer in self.stage_layers[s]:
                out = layer(out)
        if s == self.num_virtual - 1:
            out = self.loss_fn(out, self._targets[i]) * (1.0 / self.m)
            self._loss = self._loss + out.data.astype(np.float64)  # stays on the device
        elif self._rank_of(s + 1) == self.ctx.pp_rank:
            self._handover[("F", i, s + 1)] = out
        self._saved[(i, s)] = (x, out)

    def _do_SEND_F(self, a):
        out = self._saved[(a.microbatch, a.stage)][1]
        first_of_step = a.stage not in self._header_sent
        self._header_sent.add(a.stage)
        self._post_send(out.data, a.peer_stage, a.stage, gradient=False, with_header=first_of_step)

    def _do_B(self, a):
        """Backward of one micro-batch on one stage. In a split schedule (zb1) the weight
        gradients wait for the W action, so the input gradient goes upstream sooner."""
        i, s = a.microbatch, a.stage
        x, out = self._saved.pop((i, s))  # released once its backward is done
        with deferred_weight_grads() if self.split_backward else contextlib.nullcontext() as weights:
            if s == self.num_virtual - 1:
                self.backward_loss(out)
            elif ("B", i, s) in self._recvs:
                out.backward(self._take(("B", i, s)))
            else:
                out.backward(self._handover.pop(("B", i, s)))
        if weights is not None:
            self._weights[(i, s)] = weights
        if s > 0:
            if self._rank_of(s - 1) == self.ctx.pp_rank:
                self._handover[("B", i, s - 1)] = x.grad
            else:
                self._handover[("grad", i, s)] = x.grad

    def _do_W(self, a):
        self._weights.pop((a.microbatch, a.stage)).compute()

    def _do_SEND_B(self, a):
        grad = self._handover.pop(("grad", a.microbatch, a.stage))
        self._post_send(grad, a.peer_stage, a.stage, gradient=True, with_header=False)

    def _xp(self):
        return get_array_module(self._named[0][1].data) if self._named else np

    def _sum_tied_gradients(self) -> None:
        for comm, _, params in self._tied:
            for p in params:
                p.grad = p.xp.zeros_like(p.data) if p.grad is None else p.xp.ascontiguousarray(p.grad)
                comm.allreduce(p.grad, "sum", out=p.grad)

    def _share_loss(self):
        """The last stage's loss on every pipeline rank: a 0-d array on the device (all-reduced over
        pp, a one-element buffer, when there are several stages)."""
        value = self._xp().zeros(1, dtype=np.float64)
        if self.ctx.is_last_stage:
            value += self._loss
        return (self.ctx.pp.allreduce(value, "sum") if self.p > 1 else value)[0]

    # ----- inference ------------------------------------------------------------------
    def infer(self, batches):
        """Stream forward-only batches through the stages; the last stage returns their outputs.

        Stages work on different batches at once (stage 0 on batch k+p-1 while the last is on k);
        with interleaved chunks a batch visits this rank once per chunk. Returns the list of
        outputs on the rank of the last virtual stage and None elsewhere.
        """
        last = self.num_virtual - 1
        self._sends, outputs = [], []
        with no_grad():
            for batch in batches:
                handover = None
                for s in sorted(self.stage_layers):
                    if s == 0:
                        x = batch
                    elif self._rank_of(s - 1) == self.ctx.pp_rank:
                        x = handover
                    else:
                        shape, dtype = self._recv_header(s - 1)
                        buf = self._xp().empty(shape, dtype=self.wire_dtype or dtype)
                        x = Tensor(self.comm.recv(buf, self._rank_of(s - 1), _channel_tag(s - 1, False))
                                   .astype(dtype, copy=False))
                    for layer in self.stage_layers[s]:
                        x = layer(x)
                    if s == last:
                        outputs.append(x.data)
                    elif self._rank_of(s + 1) == self.ctx.pp_rank:
                        handover = x
                    else:
                        self._post_send(x.data, s + 1, s, gradient=False, with_header=True)
                self._sends = [h for h in self._sends if not h.test()]  # issue this batch's, free what has gone out
        for handle in self._sends:
            handle.wait()
        self._sends = []
        return outputs if last in self.stage_layers else None

    # ----- observability --------------------------------------------------------------
    def write_trace(self, path: str) -> None:
        """The last step of every rank as one Chrome trace (opens in Perfetto), on rank 0's clock;
        collective. ``hpcpar.runtime.trace.Tracer`` records whole runs (``train.trace``)."""
        tracer = Tracer(self.ctx.world, steps=1)
        end = self.trace[-1][2] if self.trace else self.stats.get("step_start", 0.0)
        tracer.add_recorded_step(0, self.stats.get("step_start", end), end, self.trace)
        tracer.write(path)


def _named(layer):
    return layer.named_parameters() if hasattr(layer, "named_parameters") else []


def _split(batch, m: int, what: str) -> list:
    if batch is None:
        raise ValueError(f"train_step: {what} are needed on this stage")
    if len(batch) % m:
        raise ValueError(f"train_step: a batch of {len(batch)} {what} does not split into {m} micro-batches")
    size = len(batch) // m
    return [batch[k * size: (k + 1) * size] for k in range(m)]
