"""A machine file: what the cost model needs to know about the hardware, as TOML.

Written by ``hpcpar plan calibrate`` (measured on this machine) or by hand for hardware one
cannot run on (``hpcpar/plan/machines/*.toml``: cluster nodes from their public specifications);
docs/planner.md ("Machine files") shows every key. ``[machine]``: ranks per node, cores (what
runs at once per node; more ranks share it), memory per rank, the share of DDP's bucket
all-reduces hidden behind backward (``overlap``); ``[compute.<precision>]``: achieved rates of
the op families (matrix products and attention in FLOP/s, elementwise passes in B/s, optionally
per family in ``family_bandwidth``) and the fixed costs of an op (kernel launch, Python dispatch)
and of a micro-batch through a stage; ``[network.intra]``, ``[network.inter]``: latency and the
rate at which one rank's wire bytes move. A hand-written file gives peak rates with an
``efficiency`` (``gemm_flops = 312e12`` and ``efficiency = 0.5``); the loaded machine holds
achieved rates (peak x efficiency).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field

# Elementwise op families; each moves the modelled bytes at its own rate (default: bandwidth).
FAMILIES = ("layernorm", "gelu", "softmax", "copy", "embedding", "cross_entropy", "optimizer", "pool", "im2col",
            "strided_runs", "pool_rows")  # the last two in runs per second: what a short run costs beyond its bytes
MACHINES_DIR = os.path.join(os.path.dirname(__file__), "machines")
DEFAULT_MACHINE = os.path.join("runs", "plan", "machine.toml")  # what ``hpcpar plan calibrate`` writes


def shipped() -> list[str]:
    """The machine files that come with hpcpar, by name (``dgx-a100``)."""
    return sorted(name[:-5] for name in os.listdir(MACHINES_DIR) if name.endswith(".toml"))


class MachineError(ValueError):
    """A machine file that cannot be read: one line naming the file and the key."""


@dataclass
class Compute:
    gemm_flops: float
    attention_flops: float
    bandwidth: float
    conv_flops: float = 0.0  # the products of convolutions (FLOP/s; im2col is its own family); 0: gemm_flops
    op_overhead_s: float = 0.0
    family_bandwidth: dict = field(default_factory=dict)
    model_factor: float = 1.0  # measured / op-sum time of a calibration model (calibrate.fit_model)
    micro_batch_overhead_s: float = 0.0  # fixed cost of one micro-batch through a stage (calls, loss, bookkeeping)

    def rate_of(self, family: str) -> float:
        return self.family_bandwidth.get(family, self.bandwidth)


@dataclass
class Link:
    latency_s: float
    bandwidth: float  # bytes per second of one rank's wire bytes

    def seconds(self, wire_bytes: float, messages: int = 1) -> float:
        return messages * self.latency_s + wire_bytes / self.bandwidth


@dataclass
class Machine:
    name: str
    ranks_per_node: int
    cores: int
    memory_bytes: float
    compute: dict  # precision -> Compute
    intra: Link
    inter: Link
    overlap: float = 0.0
    collectives: dict = field(default_factory=dict)  # (op, ranks) -> Link: measured, beats intra
    memory_shared: bool = False  # memory_bytes is the node's, shared by its ranks (CPUs), not each rank's
    concurrency: list = field(default_factory=list)  # measured slowdown with k ranks computing at once, k = 1..

    def slowdown(self, ranks_on_node: int) -> float:
        """How much slower compute runs with this many ranks on a node: measured, else ranks / cores."""
        if self.concurrency:
            if ranks_on_node <= len(self.concurrency):
                return max(1.0, self.concurrency[ranks_on_node - 1])
            return max(1.0, self.concurrency[-1] * ranks_on_node / len(self.concurrency))
        return max(1.0, ranks_on_node / max(self.cores, 1))
    source: str = ""

    def memory_per_rank(self, ranks_on_node: int) -> float:
        return self.memory_bytes / ranks_on_node if self.memory_shared else self.memory_bytes

    def compute_for(self, precision: str) -> Compute:
        if precision in self.compute:
            return self.compute[precision]
        return self.compute["fp32"]  # a machine measured in fp32 only (CPUs have no 16-bit GEMM)

    def link(self, op: str, ranks: int, crosses_nodes: bool) -> Link:
        """The alpha-beta line of ``op`` on a communicator of ``ranks``: measured here, else the node's links."""
        if crosses_nodes:
            return self.inter
        return self.collectives.get((op, ranks)) or self.collectives.get(("allreduce", ranks)) or self.intra


def _number(table: dict, key: str, where: str, default=None) -> float:
    value = table.get(key, default)
    if value is None:
        raise MachineError(f"{where}: missing key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise MachineError(f"{where}.{key}: expected a non-negative number, got {value!r}")
    return float(value)


def _compute(table: dict, where: str) -> Compute:
    efficiency = _number(table, "efficiency", where, 1.0)
    mem_efficiency = _number(table, "bandwidth_efficiency", where, 1.0)
    gemm = _number(table, "gemm_flops", where) * efficiency
    families = {name: _number(table.get("family_bandwidth", {}), name, f"{where}.family_bandwidth") * mem_efficiency
                for name in table.get("family_bandwidth", {})}
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise MachineError(f"{where}.family_bandwidth: unknown family {sorted(unknown)[0]!r}; known: {', '.join(FAMILIES)}")
    return Compute(gemm_flops=gemm, attention_flops=_number(table, "attention_flops", where, gemm / efficiency) * efficiency,
                   conv_flops=_number(table, "conv_flops", where, gemm / efficiency) * efficiency,
                   bandwidth=_number(table, "bandwidth", where) * mem_efficiency,
                   op_overhead_s=_number(table, "op_overhead_s", where, 0.0), family_bandwidth=families,
                   model_factor=_number(table, "model_factor", where, 1.0),
                   micro_batch_overhead_s=_number(table, "micro_batch_overhead_s", where, 0.0))


def _link(table: dict, where: str) -> Link:
    return Link(latency_s=_number(table, "latency_s", where), bandwidth=_number(table, "bandwidth", where))


def load_machine(path: str) -> Machine:
    """Read a machine file (a path, or the name of a shipped one: ``dgx-a100``)."""
    if not os.path.exists(path) and os.path.exists(os.path.join(MACHINES_DIR, path + ".toml")):
        path = os.path.join(MACHINES_DIR, path + ".toml")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as error:
        raise MachineError(f"machine file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise MachineError(f"machine file {path}: {error}") from None
    where = os.path.basename(path)
    head = data.get("machine", {})
    compute = {name: _compute(table, f"{where}: compute.{name}") for name, table in data.get("compute", {}).items()}
    if "fp32" not in compute:
        raise MachineError(f"{where}: missing table [compute.fp32]")
    network = data.get("network", {})
    if "intra" not in network:
        raise MachineError(f"{where}: missing table [network.intra]")
    intra = _link(network["intra"], f"{where}: network.intra")
    inter = _link(network["inter"], f"{where}: network.inter") if "inter" in network else intra
    collectives = {(c.get("op", "allreduce"), int(c.get("ranks", 0))): _link(c, f"{where}: collective")
                   for c in data.get("collective", [])}
    ranks = int(_number(head, "ranks_per_node", f"{where}: machine"))
    return Machine(name=str(head.get("name", where)), ranks_per_node=ranks,
                   cores=int(_number(head, "cores", f"{where}: machine", ranks)),
                   memory_bytes=_number(head, "memory_gb", f"{where}: machine") * 1e9,
                   compute=compute, intra=intra, inter=inter, overlap=min(1.0, _number(head, "overlap", f"{where}: machine", 0.0)),
                   collectives=collectives, memory_shared=bool(head.get("memory_shared", False)),
                   concurrency=[float(x) for x in head.get("concurrency", [])], source=path)


def format_machine(machine: Machine, comments: dict | None = None) -> str:
    """A machine as the TOML ``load_machine`` reads (achieved rates, efficiency 1); ``comments``: key -> text."""
    notes = comments or {}
    note = lambda key: f"  # {notes[key]}" if key in notes else ""  # noqa: E731
    lines = ["[machine]", f'name = "{machine.name}"', f"ranks_per_node = {machine.ranks_per_node}{note('ranks_per_node')}",
             f"cores = {machine.cores}{note('cores')}", f"memory_gb = {machine.memory_bytes / 1e9:.3f}{note('memory_gb')}",
             f"overlap = {machine.overlap}{note('overlap')}"] + (["memory_shared = true"] if machine.memory_shared else [])
    if machine.concurrency:
        lines.append(f"concurrency = [{', '.join(f'{x:.3f}' for x in machine.concurrency)}]{note('concurrency')}")
    for precision, c in machine.compute.items():
        lines += ["", f"[compute.{precision}]", f"gemm_flops = {c.gemm_flops:.4g}{note('gemm_flops')}",
                  f"attention_flops = {c.attention_flops:.4g}{note('attention_flops')}",
                  f"conv_flops = {c.conv_flops or c.gemm_flops:.4g}{note('conv_flops')}",
                  f"bandwidth = {c.bandwidth:.4g}{note('bandwidth')}", f"op_overhead_s = {c.op_overhead_s:.4g}{note('op_overhead_s')}",
                  f"model_factor = {c.model_factor:.4g}{note('model_factor')}",
                  f"micro_batch_overhead_s = {c.micro_batch_overhead_s:.4g}{note('micro_batch_overhead_s')}"]
        if c.family_bandwidth:
            lines += ["", f"[compute.{precision}.family_bandwidth]{note('family_bandwidth')}"]
            lines += [f"{name} = {rate:.4g}" for name, rate in c.family_bandwidth.items()]
    for name, link in (("intra", machine.intra), ("inter", machine.inter)):
        lines += ["", f"[network.{name}]{note(name)}", f"latency_s = {link.latency_s:.4g}", f"bandwidth = {link.bandwidth:.4g}"]
    for (op, ranks), link in machine.collectives.items():
        lines += ["", f"[[collective]]{note('collective')}", f'op = "{op}"', f"ranks = {ranks}",
                  f"latency_s = {link.latency_s:.4g}", f"bandwidth = {link.bandwidth:.4g}"]
    return "\n".join(lines) + "\n"
