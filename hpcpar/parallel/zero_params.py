"""ZeRO-3: a parameter lives only as this rank's part of a flat layout; its unit is gathered to run.

    params = ShardedParameters(model.layers(), names, ctx.dp, reshard_after_forward=True)
    sync = ShardedParameterSync(params, ctx, bucket_mb=25, overlap=True)  # ZeRO-2's, then units freed
    zero = ZeroRedundancyOptimizer(params.named_parameters(), ctx.dp, AdamW, parameters=params)

A unit is one of the given layers (the GPT's embedding, each block, its head); layers sharing
a parameter (a tied embedding and head) are one. Units are laid out one after another, each
one range, sharded as ZeRO-1 shards (``zero.flat_layout``). Before a unit runs, its range is
all-gathered (uneven pieces) into its buffer, whose views its parameters become, and the next
unit's gather starts; otherwise a parameter is a placeholder of its shape holding no memory.
With ``reshard_after_forward`` an unshared unit is freed after its forward (NumPy: its pages
are dropped, refilled before its backward; device arrays: the forward is a recomputed region)
and gathered again for its backward; others stay gathered to the step's end (docs/architecture.md, "ZeRO-3").
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import time

import numpy as np

from ..autograd import Parameter, Tensor, is_grad_enabled
from ..autograd.hooks import on_backward
from ..autograd.recompute import recompute
from ..backend import get_array_module, to_device
from ..nn.dropout_keys import replay_dropout_key
from ..state import Checkpointable, LoadPlan, ParameterList, Piece, Read, range_param_slabs
from .zero import flat_layout, range_pieces
from .zero_grads import BucketedReduceScatter


def reshards(reshard_after_forward: bool | None, pp: int) -> bool:
    """``parallel.reshard_after_forward``, unset: true without a pipeline, false with one (a stage's
    units are then gathered once a step, across its micro-batches, as torchtitan's default)."""
    return reshard_after_forward if reshard_after_forward is not None else pp == 1


def gathered_at_peak(units) -> int:
    """Elements of ZeRO-3's units gathered at once at a step's peak, from (elements, kept) pairs:
    every kept unit, and of the resharded ones the two largest (one running, one prefetched)."""
    return sum(n for n, kept in units if kept) + sum(sorted(n for n, kept in units if not kept)[-2:])


class Unit:
    """Layers run as one gathered piece: ``slots`` index their parameters in the layout, [begin, end)."""

    def __init__(self, name: str, layers: list, slots: list[int], begin: int, end: int, shared: bool):
        self.name, self.layers, self.slots = name, layers, slots
        self.begin, self.end, self.shared = begin, end, shared
        self.buffer = None  # the gathered parameters (or the buffer a gather in flight fills)
        self.pages = None  # freeing pages: the anonymous mapping under ``buffer``, kept for the run
        self.gathered = False  # from a gather's start to the release
        self.pending = None  # that gather's handle until it is waited for


def group_layers(layers, params_of=lambda layer: layer.parameters(), key=id) -> list[tuple[list, list]]:
    """[(layers, their parameters in first-use order)] for the layers holding parameters, those
    that share one (the same ``key``) merged into the group of the first; in the order of each
    group's first layer. ZeRO-3's units; the planner passes its own layers (``plan.predict``)."""
    groups: list[tuple[list, list]] = []
    for layer in layers:
        params = list({key(p): p for p in params_of(layer)}.values())
        if not params:
            continue
        ids = {key(p) for p in params}
        joined = [i for i, (_, held) in enumerate(groups) if ids & {key(p) for p in held}]
        if not joined:
            groups.append(([layer], params))
            continue
        merged_layers = [m for i in joined for m in groups[i][0]] + [layer]
        merged = {key(p): p for i in joined for p in groups[i][1]} | {key(p): p for p in params}
        groups[joined[0]] = (merged_layers, list(merged.values()))
        for i in reversed(joined[1:]):
            del groups[i]
    return groups


def _unit_name(layers, names: dict) -> str:
    """What debug messages call a unit: each layer's common name prefix (``blocks.3``, ``embed+head.ln_f``)."""
    parts = []
    for layer in layers:
        dotted = [names[id(p)].split(".")[:-1] for p in layer.parameters()]
        parts.append(".".join(os.path.commonprefix(dotted) or dotted[0]))
    return "+".join(dict.fromkeys(parts))


class ShardedParameters(Checkpointable):
    """The ZeRO-3 parameter store: the shard (in ``master_dtype``, default the parameters' dtype,
    a ``Parameter`` the optimizer steps in place), the units, and their gathers. As a
    Checkpointable it saves and loads ``model/<name>`` from the shard's slabs."""

    def __init__(self, layers, names: dict, comm, *, reshard_after_forward: bool, master_dtype=None,
                 free_pages: bool | None = None, params_of=lambda layer: layer.parameters()):
        """``free_pages``: how a resharded unit is freed after its forward. True (the default for
        NumPy arrays): its buffer is an anonymous mapping whose pages are dropped, the graph
        keeping its views, refilled by a gather before the unit's backward (``autograd.hooks``).
        False (the default for device arrays): the forward runs as a recomputed region.
        ``params_of``: which of a layer's parameters this store holds (expert parallelism's two
        stores: the dense ones over dp, the experts over edp, ``parallel.experts``)."""
        self.comm, self.reshard_after_forward = comm, reshard_after_forward
        groups = group_layers(layers, params_of)
        params = [p for _, group_params in groups for p in group_params]
        self.names, self.params = [names[id(p)] for p in params], params
        self.offsets, self.shard_size = flat_layout([p.size for p in params], comm.size)
        self.dtype = params[0].dtype if params else np.dtype(np.float32)
        self.xp = get_array_module(params[0].data) if params else np
        self.free_pages = self.xp is np if free_pages is None else free_pages
        self.units, slot = [], 0
        for unit_layers, unit_params in groups:
            slots = list(range(slot, slot + len(unit_params)))
            slot += len(unit_params)
            end = self.offsets[slots[-1]] + params[slots[-1]].size
            self.units.append(Unit(_unit_name(unit_layers, names), unit_layers, slots, self.offsets[slots[0]], end,
                                   shared=len(unit_layers) > 1))
        self.shard = Parameter(self._own_part(master_dtype or self.dtype), name=f"zero3_shard_{comm.rank}")
        self._placeholders = [self.xp.broadcast_to(self.xp.zeros((), p.dtype), p.shape) for p in params]
        for p, placeholder in zip(params, self._placeholders):
            p.data = placeholder  # the whole array is freed: the shard holds this rank's part
        # Each layer's unit in the order the layers run (a unit of two layers twice): what a
        # forward prefetches next, and a backward rerun before it.
        self.sequence = []
        for layer in layers:
            unit = next((u for u in self.units if any(layer is m for m in u.layers)), None)
            if unit is not None:
                layer.set_around_forward(functools.partial(self._around, unit, len(self.sequence)))
                self.sequence.append(unit)
        self.peak_gathered_bytes = 0  # the most unit memory alive at once so far
        self.wait_seconds = 0.0  # spent waiting for gathers (inside forward and backward)
        self._held = None  # the unit last rerun in backward, gathered until another reruns or a forward starts

    def _own_part(self, dtype):
        """This rank's range of the layout, copied from the parameters (every rank built the same
        ones from the seed), zeros in the padding."""
        start = self.comm.rank * self.shard_size
        shard = self.xp.zeros(self.shard_size, dtype=dtype)
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, start), min(offset + p.size, start + self.shard_size)
            if lo < hi:
                shard[lo - start: hi - start] = p.data.reshape(-1)[lo - offset: hi - offset]
        return shard

    def named_parameters(self) -> list:
        """(name, parameter) in layout order: what the gradient sync and the optimizer lay out alike."""
        return list(zip(self.names, self.params))

    def describe(self) -> str:
        shared = sum(1 for u in self.units if u.shared)
        how = "pages dropped" if self.free_pages else "recomputed"
        kept = f"resharded after forward ({how})" if self.reshard_after_forward else "kept to the step's end"
        return f"ZeRO-3: {len(self.units)} unit(s) {kept}" + (f", {shared} shared, kept" if shared else "")

    # ----- gathering ----------------------------------------------------------------
    def _reshards(self, unit: Unit, args) -> bool:
        """Whether this call of ``unit`` frees its parameters after its forward."""
        return (self.reshard_after_forward and not unit.shared and len(args) == 1
                and isinstance(args[0], Tensor))  # the hooks' and recompute's input is one Tensor

    def _around(self, unit: Unit, at: int, forward, *args, **kwargs):
        """The call of the layer at ``at`` in ``sequence``: its unit gathered while it runs; under
        grad with resharding, freed after (its pages, or run as a recomputed region)."""
        if is_grad_enabled() and not kwargs and self._reshards(unit, args):
            if self.free_pages:
                return self._run_dropping_pages(unit, at, forward, args[0])
            run = functools.partial(self._run, unit, at, forward, True)
            return recompute(run, *args, params=[self.params[s] for s in unit.slots], context=replay_dropout_key())
        return self._run(unit, at, forward, False, *args, **kwargs)

    def _run_dropping_pages(self, unit: Unit, at: int, forward, x):
        """Gathered, run with its graph, its pages dropped; the hooks gather it again before its
        backward and drop the pages after."""
        x = on_backward(x, functools.partial(self.release, unit))
        out = self._run(unit, at, forward, True, x)
        return on_backward(out, functools.partial(self._before_backward, unit, at))

    def _before_backward(self, unit: Unit, at: int) -> None:
        self.gather(unit)
        if at > 0:
            self._start(self.sequence[at - 1])  # prefetch the unit whose backward comes next

    def _run(self, unit: Unit, at: int, forward, resharding: bool, *args, **kwargs):
        rerun = resharding and is_grad_enabled() and not self.free_pages  # recompute's rerun, in backward
        if self._held is not None and (self._held is not unit or not rerun):
            # The unit rerun last is through its backward: another one reruns, or a forward starts.
            self.release(self._held)
            self._held = None
        self.gather(unit)
        neighbour = at - 1 if rerun else at + 1
        if 0 <= neighbour < len(self.sequence):
            self._start(self.sequence[neighbour])  # prefetch: in flight while this unit computes
        try:
            return forward(*args, **kwargs)
        finally:
            if rerun:
                # Held until the next unit reruns (or the step ends): the rerun's backward, and a
                # region recomputed inside it (model.recompute = "full"), still read the parameters.
                self._held = unit
            elif resharding or not is_grad_enabled():  # kept only when a backward will read the arrays
                self.release(unit)

    def _start(self, unit: Unit) -> None:
        """Start gathering ``unit`` unless it is gathered or on its way."""
        if unit.gathered:
            return
        size, rank = self.shard_size, self.comm.rank
        counts = range_pieces(unit.begin, unit.end, size, self.comm.size)
        lo = max(unit.begin, rank * size) - rank * size
        mine = self.shard.data[lo: lo + counts[rank]]
        if mine.dtype != self.dtype:  # float32 masters gathered in the compute dtype
            mine = mine.astype(self.dtype)
        if unit.buffer is None:
            unit.buffer = self._new_buffer(unit)
        unit.gathered = True
        unit.pending = self.comm.iallgather(mine, counts, unit.buffer, label=unit.name)
        alive = sum(u.buffer.nbytes for u in self.units if u.gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, alive)

    def _new_buffer(self, unit: Unit):
        n = unit.end - unit.begin
        if not self.free_pages:
            return self.xp.empty(n, dtype=self.dtype)
        # Private: dropping a shared mapping's pages keeps their contents (and memory) for the next touch.
        unit.pages = mmap.mmap(-1, n * self.dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return np.frombuffer(unit.pages, dtype=self.dtype, count=n)

    def gather(self, unit: Unit) -> None:
        """``unit``'s parameters whole, as views of its gathered buffer."""
        self._start(unit)
        if unit.pending is None:
            return
        self._wait(unit)
        for slot in unit.slots:
            p, at = self.params[slot], self.offsets[slot] - unit.begin
            p.data = unit.buffer[at: at + p.size].reshape(p.shape)

    def release(self, unit: Unit) -> None:
        """Free ``unit``'s gathered parameters: drop its pages (the graph's views of them read
        zeros until the next gather refills them), or its buffer (the graph keeps what it holds)."""
        if not unit.gathered:
            return
        if unit.pending is not None:
            self._wait(unit)  # MPI writes into it until then
        for slot in unit.slots:
            self.params[slot].data = self._placeholders[slot]
        if unit.pages is not None:
            unit.pages.madvise(mmap.MADV_DONTNEED)
        else:
            unit.buffer = None
        unit.gathered = False

    def _wait(self, unit: Unit) -> None:
        start = time.perf_counter()
        unit.pending.wait()
        unit.pending = None
        self.wait_seconds += time.perf_counter() - start

    def release_all(self) -> None:
        """The step's end (or a load): no unit stays gathered."""
        for unit in self.units:
            self.release(unit)
        self._held = None

    # ----- the checkpoint protocol (hpcpar.state) -------------------------------------
    def _slabs(self):
        begin = self.comm.rank * self.shard_size
        return range_param_slabs(self.names, self.params, self.offsets, begin, begin + self.shard_size)

    def checkpoint_pieces(self) -> tuple[list, dict]:
        pieces = [Piece(f"model/{name}", shape, glob, self.shard.data[at: at + math.prod(local)].reshape(local))
                  for name, _, shape, glob, local, at in self._slabs()]
        return pieces, {}

    def load_plan(self, saved) -> LoadPlan:
        """Each slab of the shard from its ``model/<name>``; gathered units are stale after, so freed."""
        flat = self.shard.data

        def into(at):
            def assign(values):
                flat[at: at + values.size] = to_device(values, self.xp).reshape(-1)
            return assign

        reads = [Read(f"model/{name}", shape, glob, into(at), flat.dtype, flat[at: at + math.prod(local)].reshape(local))
                 for name, _, shape, glob, local, at in self._slabs()]
        return LoadPlan(reads, [self.release_all])


class ShardedParameterSync(BucketedReduceScatter):
    """ZeRO-3's gradient sync: ZeRO-2's bucketed reduce-scatter over the units' layout into the
    shard's dtype; at the step's end the units kept gathered are freed."""

    def __init__(self, parameters: ShardedParameters, ctx, *, bucket_mb: float, overlap: bool, replicas=None):
        super().__init__(ParameterList(parameters.named_parameters()), ctx, bucket_mb=bucket_mb, overlap=overlap,
                         dtype=parameters.shard.dtype, comm=parameters.comm, replicas=replicas)
        self.parameters = parameters

    def finish(self) -> None:
        super().finish()
        self.parameters.release_all()

    @property
    def seconds(self) -> float:
        """Waiting for the reduce-scatters and for the units' gathers, so far."""
        return self.sync_seconds + self.parameters.wait_seconds

    def describe(self) -> str:
        return f"{self.parameters.describe()}, {len(self.buckets)} reduce-scatter bucket(s)"
