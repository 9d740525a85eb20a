"""The pipeline engine: executes a schedule's actions on this rank's stages.

    ctx = hpcpar.init(pp=4)
    pipe = PipelineParallel(GPT(config), ctx, schedule="1f1b", micro_batches=8)  # loss: model.loss_from_logits
    optimizer = AdamW(pipe.named_parameters(), lr=3e-4)
    loss = pipe.train_step(ids, targets)      # the same mean loss on every pipeline rank
    optimizer.step(); optimizer.zero_grad()

The engine keeps only what the schedule needs: this rank's ``Stages`` (``stages.py``), the
gradient sync it is handed (``parallel.grad_sync``), how the last stage's backward runs
(``backward_loss``). Each ``train_step`` makes a ``StepState`` (``step.py``) with its own
``StageChannel`` (``channel.py``) and runs the actions on it; ``infer`` streams batches through
the same channel. The execution contract is in docs/architecture.md.
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
from ..grad_sync import make_gradient_sync
from .channel import StageChannel
from .schedules import make_schedule
from .stages import Stages
from .step import StepState, share_loss, split


class PipelineParallel(ParameterHolder):
    def __init__(self, model, ctx, schedule: str = defaults.PIPELINE_SCHEDULE, micro_batches: int = defaults.MICRO_BATCHES,
                 loss_fn=None, partition="uniform", chunks: int = defaults.CHUNKS, sample_input=None, wire_dtype=None,
                 bucket_mb: float = defaults.BUCKET_MB,
                 dp_average: bool = True, backward_loss=None, compression=None, grad_sync=None):
        """``model``: a model, or its ``Stages`` already cut (then ``chunks``, ``partition`` and
        ``sample_input`` are theirs). ``grad_sync``: the gradient sync the strategy built over the
        stages; without one, ``parallel.grad_sync``'s rule picks it from ``dp_average`` (False:
        ZeRO-1 reduces in the optimizer), ``compression`` and ``bucket_mb``. ``backward_loss(loss)``
        runs the last stage's backward (mixed precision: ``amp.backward``, which seeds it with the
        loss scale)."""
        loss_fn = loss_fn or getattr(model, "loss_from_logits", None)
        if loss_fn is None:
            raise ValueError("PipelineParallel needs loss_fn(output, targets) for the last stage")
        self.stages = model if isinstance(model, Stages) else Stages(model, ctx, chunks, partition, sample_input)
        self.ctx, self.comm = ctx, ctx.pp
        self.p, self.v, self.m = ctx.pp_size, self.stages.num_virtual // ctx.pp_size, micro_batches
        self.num_virtual = self.stages.num_virtual
        self.loss_fn = loss_fn
        self.backward_loss = backward_loss or (lambda loss: loss.backward())
        self.wire_dtype = np.dtype(wire_dtype) if wire_dtype is not None else None
        self.schedule_name = schedule
        self.actions = make_schedule(schedule, self.p, micro_batches, self.v)[ctx.pp_rank]
        self.split_backward = any(a.kind == "W" for a in self.actions)  # zero bubble: B and W apart
        self.grad_sync = grad_sync or make_gradient_sync(self.stages, ctx, sharded=not dp_average,
                                                         compression=compression, bucket_mb=bucket_mb,
                                                         overlap=False, alone=self.stages.tied.params())
        self._last_step: StepState | None = None  # what ``stats``, ``trace`` and ``_sends`` read

    # ----- parameters and what tests and reports read ---------------------------------
    def named_parameters(self):
        """This rank's parameters under their names in the whole model (tied ones on each holder)."""
        return self.stages.named_parameters()

    def parameters(self):
        return [p for _, p in self.stages.named_parameters()]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def owns_for_norm(self, param) -> bool:
        return self.stages.tied.owns_for_norm(param)

    @property
    def bounds(self) -> list:
        return self.stages.bounds

    @property
    def ddp(self):
        return self.grad_sync.ddp

    @property
    def _tied(self) -> list:
        return self.stages.tied.groups

    @property
    def stats(self) -> dict:
        return self._last_step.stats if self._last_step else {}

    @property
    def trace(self) -> list:
        return self._last_step.trace if self._last_step else []

    @property
    def _sends(self) -> list:
        return self._last_step.channel.sends if self._last_step else []

    # ----- transport: the seams between the actions and the step's channel ---------------
    def _channel(self) -> StageChannel:
        return StageChannel(self.comm, self.stages.rank_of, self.wire_dtype)

    def _post_send(self, step, array, to_stage: int, from_stage: int, gradient: bool) -> None:
        step.channel.send(array, to_stage, from_stage, gradient)

    def _post_recv(self, step, from_stage: int, gradient: bool, shape, dtype, xp):
        return step.channel.post_recv(from_stage, gradient, shape, dtype, xp)

    def _xp(self):
        named = self.stages.named_parameters()
        return get_array_module(named[0][1].data) if named else np

    # ----- one training step --------------------------------------------------------
    def train_step(self, inputs, targets):
        """Forward and backward of the whole batch through the pipeline; returns the mean loss, a
        0-d array on the device (the same on every pipeline rank).

        ``inputs`` matter on the first stage and ``targets`` on the last (others may pass None).
        Gradients are left in the parameters (summed over micro-batches, then as the gradient
        sync leaves them: averaged over dp, or for ZeRO's optimizer to reduce).
        """
        step = StepState(self._channel(), split(inputs, self.m, "inputs") if self.ctx.is_first_stage else None,
                         split(targets, self.m, "targets") if self.ctx.is_last_stage else None)
        self._last_step = step
        pp_seconds_before = self.ctx.pp.stats.total_seconds
        with self.grad_sync.no_sync():
            for action in self.actions:
                start, idle_before = time.perf_counter(), step.idle
                getattr(self, "_do_" + action.kind)(step, action)
                step.record(action, start, time.perf_counter(), idle_before)
                step.channel.release_sent()
        send_wait = time.perf_counter()
        step.channel.wait_sent()
        comm_start = time.perf_counter()
        self.stages.tied.sum_gradients()
        self.grad_sync.finish()
        loss = share_loss(self.ctx, step.loss, self._xp())
        step.finish(comm_start, send_wait, self.ctx.pp.stats.total_seconds - pp_seconds_before,
                    self.p, self.m, self.v)
        return loss

    def _do_RECV_F(self, step, a):
        start = time.perf_counter()
        shape, dtype = step.channel.activation_shape(a.peer_stage)  # the handshake on micro-batch 0
        step.idle += time.perf_counter() - start  # waiting for the previous stage: the bubble
        step.recvs[("F", a.microbatch, a.stage)] = self._post_recv(step, a.peer_stage, False, shape, dtype,
                                                                   self._xp())

    def _do_RECV_B(self, step, a):
        output = step.saved[(a.microbatch, a.stage)][1]
        step.recvs[("B", a.microbatch, a.stage)] = self._post_recv(step, a.peer_stage, True, output.shape,
                                                                   output.dtype, output.xp)

    def _do_F(self, step, a):
        i, s = a.microbatch, a.stage
        if s == 0:
            x = step.inputs[i]
        else:
            arrived = step.take(("F", i, s)) if ("F", i, s) in step.recvs else step.handover.pop(("F", i, s)).data
            x = Tensor(arrived, requires_grad=True)
        with offset_dropout_key(i * x.shape[0]):  # micro-batch i's rows: the masks one process draws for them
            out = self._run_layers(s, x)
        if s == self.num_virtual - 1:
            out = self.loss_fn(out, step.targets[i]) * (1.0 / self.m)
            step.loss = step.loss + out.data.astype(np.float64)  # stays on the device
        elif self.stages.is_mine(s + 1):
            step.handover[("F", i, s + 1)] = out
        step.saved[(i, s)] = (x, out)

    def _do_SEND_F(self, step, a):
        self._post_send(step, step.saved[(a.microbatch, a.stage)][1].data, a.peer_stage, a.stage, gradient=False)

    def _do_B(self, step, a):
        """Backward of one micro-batch on one stage. In a split schedule (zb1) the weight
        gradients wait for the W action, so the input gradient goes upstream sooner."""
        i, s = a.microbatch, a.stage
        x, out = step.saved.pop((i, s))  # released once its backward is done
        with deferred_weight_grads() if self.split_backward else contextlib.nullcontext() as weights:
            if s == self.num_virtual - 1:
                self.backward_loss(out)
            elif ("B", i, s) in step.recvs:
                out.backward(step.take(("B", i, s)))
            else:
                out.backward(step.handover.pop(("B", i, s)))
        if weights is not None:
            step.weights[(i, s)] = weights
        if s > 0:
            step.handover[("B", i, s - 1)] = x.grad

    def _do_W(self, step, a):
        step.weights.pop((a.microbatch, a.stage)).compute()

    def _do_SEND_B(self, step, a):
        grad = step.handover.pop(("B", a.microbatch, a.peer_stage))
        self._post_send(step, grad, a.peer_stage, a.stage, gradient=True)

    def _run_layers(self, stage: int, x):
        for layer in self.stages.layers[stage]:
            x = layer(x)
        return x

    # ----- inference ------------------------------------------------------------------
    def infer(self, batches):
        """Stream forward-only batches through the stages; the last stage returns their outputs.

        Stages work on different batches at once (stage 0 on batch k+p-1 while the last is on k);
        with interleaved chunks a batch visits this rank once per chunk. Each batch agrees its
        shapes anew. Returns the list of outputs on the rank of the last virtual stage and None elsewhere.
        """
        last = self.num_virtual - 1
        channel, outputs = self._channel(), []
        with no_grad():
            for x in batches:
                channel.new_shapes()
                for s in sorted(self.stages.layers):
                    if s > 0 and not self.stages.is_mine(s - 1):
                        x = Tensor(channel.receive(s - 1, self._xp()))
                    x = self._run_layers(s, x)  # from the previous stage on this rank when it is one
                    if s == last:
                        outputs.append(x.data)
                    elif not self.stages.is_mine(s + 1):
                        channel.send(x.data, s + 1, s, gradient=False)
                channel.release_sent(start_queued=True)  # issue this batch's, free what has gone out
        channel.wait_sent()
        return outputs if last in self.stages.layers else None

    # ----- observability --------------------------------------------------------------
    def write_trace(self, path: str) -> None:
        """The last step of every rank as one Chrome trace (opens in Perfetto), on rank 0's clock;
        collective. ``hpcpar.runtime.trace.Tracer`` records whole runs (``train.trace``)."""
        tracer = Tracer(self.ctx.world, steps=1)
        end = self.trace[-1][2] if self.trace else self.stats.get("step_start", 0.0)
        tracer.add_recorded_step(0, self.stats.get("step_start", end), end, self.trace)
        tracer.write(path)
