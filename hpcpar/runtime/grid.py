"""The grid of ranks as a table of named axes: sizes, rank order, coordinates, groups, labels.

``GRID`` is hpcpar's table (dp, pp, tp, cp); a ``Mesh`` is a table with a size per axis. Everything
here is arithmetic on sizes, so every rank reaches the same answer without communicating
(``context.py`` builds the communicators along the axes). Layouts are spelt in table order
(``2x1x4``: dp 2, pp 1, tp 4; a ``suffix`` axis only above 1: ``2x1x4-cp2``); ranks are numbered
in ``rank_order``, the last axis fastest (tp, then cp, dp, pp: docs/architecture.md, runtime).
An axis nothing uses yet (limit 1) has a communicator and a coordinate (0) but is not spelt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """The requested layout does not fit the world."""


@dataclass(frozen=True)
class Axis:
    name: str  # "tp": ctx.tp, ctx.tp_size, ctx.tp_rank and the job key parallel.tp
    role: str  # what one coordinate along it is: "shard" (a row of ``Mesh.format``)
    kind: str  # the parallelism it is: "tensor" (``hpcpar compare``'s "pure tensor")
    help: str  # the job key's meaning
    limit: int | None = None  # the largest size anything supports (1: an axis nothing uses yet)
    suffix: bool = False  # spelt after the digits, by name, only above 1 ("2x1x1-cp2"): labels of before stay

    @property
    def varies(self) -> bool:
        """Whether its size can exceed 1: only such axes are spelt."""
        return self.limit is None or self.limit > 1


@dataclass(frozen=True)
class AxisTable:
    axes: tuple[Axis, ...]  # in the order layouts are spelt
    rank_order: tuple[str, ...]  # slowest to fastest: consecutive ranks differ in the last
    fill: str  # the axis whose size, left unset, fills the world

    def __post_init__(self):
        if sorted(self.rank_order) != sorted(self.names) or self.fill not in self.spelt:
            raise ValueError(f"rank order {self.rank_order} and fill {self.fill!r} must name the axes {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(axis.name for axis in self.axes)

    @property
    def spelt(self) -> tuple[str, ...]:
        """The axes whose size can exceed 1, in table order: the job keys, "dp x pp x tp"."""
        return tuple(axis.name for axis in self.axes if axis.varies)

    @property
    def spelt_order(self) -> tuple[str, ...]:
        """The ``spelt`` axes in rank order, slowest first: the coordinates and the grid table."""
        return tuple(name for name in self.rank_order if name in self.spelt)

    def axis(self, name: str) -> Axis:
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise ValueError(f"axis must be one of {self.names}, got {name!r}")

    def sizes(self, positional: tuple, named: dict, unset) -> tuple:
        """One value per axis, in table order: ``positional`` in ``spelt`` order, then ``named``;
        the axes given neither get ``unset(name)``."""
        if len(positional) > len(self.spelt):
            raise TypeError(f"{len(positional)} sizes for the {len(self.spelt)} axes {self.spelt}")
        given = dict(zip(self.spelt, positional))
        for name, value in named.items():
            if name not in self.names or name in given:
                raise TypeError(f"{name!r}: " + ("given twice" if name in given else f"not an axis of {self.names}"))
            given[name] = value
        return tuple(given[name] if name in given else unset(name) for name in self.names)

    def mesh(self, *sizes, **named) -> "Mesh":
        """The mesh of the given sizes (positional in ``spelt`` order, or by name; absent: 1)."""
        return Mesh(self, self.sizes(sizes, named, lambda name: 1))

    def resolve(self, world_size: int, *sizes, **named) -> "Mesh":
        """The mesh whose product is ``world_size`` (the fill axis, unset, takes what is left), or
        LayoutError naming the numbers. Sizes as for ``mesh``; the fill axis's default is unset."""
        values = dict(zip(self.names, self.sizes(sizes, named, lambda name: None if name == self.fill else 1)))
        self._check(values)
        # the axes that cannot vary are at 1 now; a suffix axis at 1 is left out of the messages
        others = [n for n in self.spelt if n != self.fill and (not self.axis(n).suffix or values[n] != 1)]
        product = math.prod(values[n] for n in others)
        if values[self.fill] is None:
            if world_size % product:
                names, numbers = " x ".join(others), " x ".join(str(values[n]) for n in others)
                raise LayoutError(
                    f"world size {world_size} is not divisible by {names} = {numbers} = {product}; "
                    f"launch a multiple of {product} ranks or change {'/'.join(others)}")
            values[self.fill] = world_size // product
        mesh = Mesh(self, tuple(values[n] for n in self.names))
        if mesh.world_size != world_size:
            shown = [n for n in self.spelt if mesh.shown(n)]
            raise LayoutError(
                f"{' x '.join(shown)} = {' x '.join(str(mesh.size(n)) for n in shown)} = {mesh.world_size} does not equal "
                f"the world size {world_size}; launch {mesh.world_size} ranks or leave {self.fill} unset to fill the world")
        return mesh

    def _check(self, values: dict) -> None:
        """LayoutError unless every size given is a positive integer within its axis's limit."""
        for name in [n for n in self.names if n != self.fill] + [self.fill]:
            value, limit = values[name], self.axis(name).limit
            if value is None and name == self.fill:
                continue
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
            if limit is not None and value > limit:
                raise LayoutError(f"{name} must be at most {limit}, got {value}")

    def factorisations(self, world_size: int) -> list["Mesh"]:
        """Every mesh of ``world_size`` ranks within the axes' limits, in table order lexicographically."""
        def split(n: int, axes: tuple[Axis, ...]) -> list[tuple]:
            fits = [d for d in range(1, n + 1) if n % d == 0 and (axes[0].limit is None or d <= axes[0].limit)]
            if len(axes) == 1:
                return [(n,)] if n in fits else []
            return [(d,) + rest for d in fits for rest in split(n // d, axes[1:])]
        return [Mesh(self, sizes) for sizes in split(world_size, self.axes)]


@dataclass(frozen=True)
class Mesh:
    """A size for every axis of a table: the layout of a world of ranks."""

    table: AxisTable
    sizes: tuple[int, ...]  # in table order

    @property
    def names(self) -> tuple[str, ...]:
        return self.table.names

    def size(self, name: str) -> int:
        return self.sizes[self.table.names.index(self.table.axis(name).name)]

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of the ``spelt`` axes: (dp, pp, tp)."""
        return tuple(self.size(name) for name in self.table.spelt)

    def by_name(self) -> dict[str, int]:
        """{axis: size} of the ``spelt`` axes, as the job's keys and ``ctx.layout`` name them."""
        return dict(zip(self.table.spelt, self.shape))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def shown(self, name: str) -> bool:
        """Whether labels, words and tables spell this axis (a suffix axis only above 1)."""
        return not self.table.axis(name).suffix or self.size(name) > 1

    def label(self) -> str:
        """The layout as hpcpar spells it: "2x1x4", "2x1x4-cp2"."""
        digits = "x".join(str(size) for name, size in self.by_name().items() if not self.table.axis(name).suffix)
        return digits + "".join(f"-{name}{size}" for name, size in self.by_name().items()
                                if self.table.axis(name).suffix and size > 1)

    def words(self) -> str:
        """The layout in words: "dp 2 x pp 1 x tp 4" (x cp 2)."""
        return " x ".join(f"{name} {size}" for name, size in self.by_name().items() if self.shown(name))

    def stride(self, name: str) -> int:
        """How far apart in world rank two neighbours along ``name`` are."""
        order = self.table.rank_order
        return math.prod(self.size(n) for n in order[order.index(name) + 1:])

    def coordinate(self, world_rank: int, name: str) -> int:
        return world_rank // self.stride(name) % self.size(name)

    def coordinates(self, world_rank: int) -> tuple[int, ...]:
        """The coordinates of a world rank on the ``spelt`` axes, slowest first: (pp, dp, tp)."""
        return tuple(self.coordinate(world_rank, name) for name in self.table.spelt_order)

    def groups(self, *names: str) -> list[list[int]]:
        """The world ranks of every communicator along the axes ``names`` (one axis or a product
        of several): the ranks whose coordinates agree on every other axis, lowest first."""
        others = [n for n in self.table.names if n not in {self.table.axis(name).name for name in names}]
        found: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            found.setdefault(tuple(self.coordinate(rank, n) for n in others), []).append(rank)
        return list(found.values())

    def format(self) -> str:
        """The whole grid as text: a column per world rank, a row per ``spelt`` axis (slowest first)."""
        ranks = range(self.world_size)
        width = max(2, len(str(self.world_size - 1)))
        rows = [("world rank", list(ranks))]
        rows += [(f"{name} ({self.table.axis(name).role})", [self.coordinate(r, name) for r in ranks])
                 for name in self.table.spelt_order if self.shown(name)]
        return "\n".join(f"{label:<13}" + " ".join(f"{v:>{width}}" for v in values) for label, values in rows)


GRID = AxisTable(
    axes=(Axis("dp", "replica", "data", "data-parallel replicas"),
          Axis("pp", "stage", "pipeline", "pipeline stages"),
          Axis("tp", "shard", "tensor", "tensor-parallel shards of each layer"),
          Axis("cp", "chunk", "context", "context-parallel ranks splitting each sequence (zigzag chunks, ring "
               "attention)", suffix=True)),
    rank_order=("pp", "dp", "cp", "tp"),
    fill="dp",
)


def mesh_of(*sizes, **named) -> Mesh:
    """A ``GRID`` mesh from sizes in table order or by name, or the Mesh given."""
    if len(sizes) == 1 and isinstance(sizes[0], Mesh) and not named:
        return sizes[0]
    return GRID.mesh(*sizes, **named)


def resolve_layout(world_size: int, *sizes, **named) -> tuple[int, ...]:
    """``GRID``'s sizes (dp, pp, tp, cp) whose product is ``world_size``, or raise LayoutError naming
    the numbers (``AxisTable.resolve``): pure arithmetic, so every rank reaches the same verdict."""
    return GRID.resolve(world_size, *sizes, **named).shape


def coordinates(world_rank: int, *sizes, **named) -> tuple[int, ...]:
    """(pp_rank, dp_rank, cp_rank, tp_rank) of a world rank: slowest axis first."""
    return mesh_of(*sizes, **named).coordinates(world_rank)


def format_grid(*sizes, **named) -> str:
    return mesh_of(*sizes, **named).format()
