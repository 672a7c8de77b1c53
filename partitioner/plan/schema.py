"""The plan file's schema: every field's type and allowed values, checked before a Plan is built.

Legend: ``p`` stages, ``s`` a stage index.

``check(data, PLAN_SCHEMA, where)`` walks a ``Plan.to_dict()``-shaped value and raises
:class:`~partitioner.errors.PlanFieldError` at the first field that is not what ``Plan.save``
writes, naming its path (``stages[1].memory``), the value and what is allowed:

- integers are JSON integers: ``true`` is not 1 and ``4.5`` (or ``4.0``) is not 4;
- numbers are finite (no ``NaN``, no ``Infinity``) except where infinity means "unlimited"
  (a stage's ``capacity``, written as ``null``; a device's memory and bandwidths); sizes, times,
  counts and capacities are not negative;
- schedule names are the registry's (``partitioner.schedule.registry``), precisions and
  granularities the ones a plan is made with;
- a record holds no key its dataclass lacks: an unknown key is refused, not dropped, because a
  plan is written whole by ``plan.save`` (under a checksum) and a key this version does not know
  means a hand edit or another format, whose meaning would be lost silently.

A record's fields are read off its dataclass (``StagePlan``, ``Prediction``, ...), so a field added
there is checked by its annotated type without an edit here; the overrides below say only what the
type does not (a stage index, a schedule name, an unlimited capacity).

Written here rather than with jsonschema or pydantic: neither is a dependency of pipecut, JSON
Schema counts ``4.0`` as an integer and ``NaN`` as a number, and both word their messages in
their own terms, where ours say how to re-create the file.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from partitioner.cost.devices import DeviceSpec
from partitioner.cost.precision import PRECISIONS
from partitioner.errors import PlanFieldError
from partitioner.plan.layout import ZERO_OPTIONS, Layout
from partitioner.plan.records import Candidate, InferenceSummary, Prediction, StagePlan
from partitioner.plan.split import ValueSpec
from partitioner.schedule.registry import schedule_names

__all__ = ["Spec", "Num", "Text", "Flag", "ListOf", "MapOf", "Maybe", "Record", "record_of", "check", "PLAN_SCHEMA"]


class Spec:
    """One field's rule: ``check`` returns nothing or raises ``PlanFieldError`` for ``path``."""

    def check(self, value: Any, path: str, where: str) -> None:
        raise NotImplementedError  # internal invariant: every rule defines it

    def allowed(self) -> str:
        """What the field takes, in words (for the error message)."""
        raise NotImplementedError  # internal invariant: every rule defines it

    def _fail(self, value: Any, path: str, where: str, allowed: str | None = None) -> PlanFieldError:
        return PlanFieldError(where, path, value, allowed or self.allowed())


@dataclass(frozen=True)
class Num(Spec):
    """A JSON number: ``integer`` (never a bool or a float) or any real; finite, at least ``minimum``.

    Example:
        >>> Num(integer=True, minimum=1).allowed()
        'an integer >= 1'
        >>> Num(unlimited=True).allowed()
        'a finite number >= 0, or null (unlimited)'
    """

    integer: bool = False
    minimum: float | None = 0.0
    maximum: float | None = None
    unlimited: bool = False  # null and +Infinity mean "no limit" (read as math.inf)

    def check(self, value: Any, path: str, where: str) -> None:
        if self.unlimited and (value is None or value == math.inf):
            return
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
            raise self._fail(value, path, where)
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise self._fail(value, path, where)

    def allowed(self) -> str:
        text = "an integer" if self.integer else "a finite number"
        if self.minimum is not None and self.maximum is not None:
            text += f" from {self.minimum:g} to {self.maximum:g}"
        elif self.minimum is not None:
            text += f" >= {self.minimum:g}"
        return text + (", or null (unlimited)" if self.unlimited else "")


@dataclass(frozen=True)
class Text(Spec):
    """A JSON string, one of ``choices`` when given."""

    choices: tuple[str, ...] | None = None

    def check(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
            raise self._fail(value, path, where)

    def allowed(self) -> str:
        return "a string" if self.choices is None else "one of " + ", ".join(map(repr, self.choices))


@dataclass(frozen=True)
class Flag(Spec):
    """A JSON ``true`` or ``false``."""

    def check(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, bool):
            raise self._fail(value, path, where)

    def allowed(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Maybe(Spec):
    """``null``, or what ``item`` takes."""

    item: Spec

    def check(self, value: Any, path: str, where: str) -> None:
        if value is not None:
            self.item.check(value, path, where)

    def allowed(self) -> str:
        return f"null or {self.item.allowed()}"


@dataclass(frozen=True)
class _Each(Spec):
    """A JSON container whose every entry ``item`` takes (entry ``label`` checked as ``path[label]``)."""

    item: Spec
    _types: ClassVar[tuple[type, ...]]
    _what: ClassVar[str]
    """What :meth:`allowed` says before the item's own ``allowed``."""

    @staticmethod
    def _entries(value: Any) -> Iterable[tuple[object, Any]]:
        """``(label, entry)`` of each entry of ``value``: an array's index, an object's key (repr)."""
        if isinstance(value, dict):
            return ((repr(k), x) for k, x in value.items())
        return enumerate(value)

    def check(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, self._types):
            raise self._fail(value, path, where)
        for label, x in self._entries(value):
            self.item.check(x, f"{path}[{label}]", where)

    def allowed(self) -> str:
        return f"{self._what} {self.item.allowed()}"


@dataclass(frozen=True)
class ListOf(_Each):
    """A JSON array whose every item ``item`` takes (checked as ``path[i]``); a tuple too, as
    ``Plan.to_dict`` returns before it is written as JSON."""

    _types = (list, tuple)
    _what = "a list, each item"


@dataclass(frozen=True)
class MapOf(_Each):
    """A JSON object of any string keys, each value taken by ``item`` (checked as ``path['key']``)."""

    _types = (dict,)
    _what = "an object, each value"


@dataclass(frozen=True)
class Record(Spec):
    """A JSON object with exactly these keys (the ``optional`` ones may be absent), each checked."""

    name: str
    keys: Mapping[str, Spec]
    optional: frozenset[str] = frozenset()

    def check(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, dict):
            raise self._fail(value, path, where)
        for key in sorted(set(value) - set(self.keys)):
            raise PlanFieldError(
                where, _join(path, key), value[key], f"a {self.name} holds {', '.join(self.keys)}", unknown=True
            )
        for key, spec in self.keys.items():
            if key in value:
                spec.check(value[key], _join(path, key), where)
            elif key not in self.optional:
                raise PlanFieldError(where, _join(path, key), _ABSENT, f"{spec.allowed()} (the field is required)")

    def allowed(self) -> str:
        return f"an object (a {self.name})"


def record_of(cls: type, overrides: Mapping[str, Spec] | None = None, *,
              optional: frozenset[str] | None = None) -> Record:
    """The ``Record`` of a frozen dataclass: each field by its annotation, unless overridden.

    ``int`` is ``Num(integer=True)``, ``float`` ``Num()`` (both >= 0), ``str`` ``Text()``, ``bool``
    ``Flag()``, ``tuple[X, ...]`` ``ListOf(X)``; ``overrides`` replace those rules by field name;
    ``optional`` (the fields that may be absent) defaults to the fields with defaults.

    Example:
        >>> rec = record_of(Prediction, {"schedule": Text(("1f1b",))})
        >>> rec.keys["microbatches"], sorted(rec.optional)
        (Num(integer=True, minimum=0.0, maximum=None, unlimited=False), ['chunks', 'memory'])
    """
    hints = typing.get_type_hints(cls)
    given = overrides or {}
    keys = {f.name: given.get(f.name) or _by_type(hints[f.name], cls, f.name) for f in fields(cls)}
    if optional is None:
        optional = frozenset(f.name for f in fields(cls) if f.default is not MISSING)
    return Record(cls.__name__, keys, optional)


def check(data: Any, spec: Spec, where: str = "plan") -> None:
    """Raise ``PlanFieldError`` at the first field of ``data`` that ``spec`` does not take.

    Example:
        >>> check({"a": 1}, Record("thing", {"a": Num(integer=True)}))
        >>> check({"a": True}, Record("thing", {"a": Num(integer=True)}), "p.json")
        Traceback (most recent call last):
        ...
        partitioner.errors.PlanFieldError: p.json: field a is True, expected an integer >= 0. The file is ...
    """
    spec.check(data, "", where)


def _by_type(hint: Any, cls: type, name: str) -> Spec:
    simple: dict[Any, Callable[[], Spec]] = {
        int: lambda: Num(integer=True), float: Num, str: Text, bool: Flag,
    }
    if hint in simple:
        return simple[hint]()
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ListOf(_by_type(args[0], cls, name))
    # A record field of a type with no rule is a bug here, found on import: write its override.
    raise TypeError(f"{cls.__name__}.{name}: no schema rule for {hint!r}")  # internal invariant


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class _Absent:
    def __repr__(self) -> str:
        return "missing"


_ABSENT = _Absent()

# -- the plan's records -----------------------------------------------------------------------

_SCHEDULE = Text(schedule_names())
_UNLIMITED = Num(unlimited=True)  # JSON has no infinity: an unlimited capacity is written as null


def _unlimited_floats(cls: type) -> dict[str, Spec]:
    # Candidate and Layout rows are written with every infinity as null (a row that was not priced).
    hints = typing.get_type_hints(cls)
    return {f.name: _UNLIMITED for f in fields(cls) if hints[f.name] is float}


STAGE = record_of(
    StagePlan, {"capacity": _UNLIMITED},
    # added after format version 1 was first written
    optional=frozenset({"in_bytes", "recompute", "kv_bytes", "work_bytes", "sequences"}),
)
INFERENCE = record_of(InferenceSummary, {
    "batch": Num(integer=True, minimum=1), "max_len": Num(integer=True, minimum=1),
    "prompt_len": Num(integer=True, minimum=1), "dtype": Text(tuple(PRECISIONS)),
    "groups": Num(integer=True, minimum=1),
})
PREDICTION = record_of(Prediction, {
    "schedule": _SCHEDULE, "microbatches": Num(integer=True, minimum=1), "bubble": Num(minimum=0, maximum=1),
    "chunks": Num(integer=True, minimum=1),
})
CANDIDATE = record_of(Candidate, {**_unlimited_floats(Candidate), "schedule": _SCHEDULE})
LAYOUT = record_of(Layout, {
    **_unlimited_floats(Layout), "schedule": _SCHEDULE, "zero": Text(ZERO_OPTIONS),
    "dp": Num(integer=True, minimum=1), "pp": Num(integer=True, minimum=1),
})
VALUE = record_of(ValueSpec, {"producer": Num(integer=True, minimum=-1)})  # -1: a graph input
IO = Record("stage wiring", {"stage": Num(integer=True), "inputs": ListOf(VALUE), "outputs": ListOf(VALUE)})
# A device's memory and bandwidths may be unlimited (Cluster.to_dict writes them as Infinity).
_DEVICE_UNLIMITED = (
    "memory", "mem_bandwidth", "link_bandwidth", "inter_node_bandwidth", "peak_flops", "peak_flops_fp32",
)
DEVICE = record_of(DeviceSpec, dict.fromkeys(_DEVICE_UNLIMITED, _UNLIMITED))
CLUSTER = Record(
    "cluster",
    {
        "devices": ListOf(DEVICE), "link_bandwidth": ListOf(_UNLIMITED), "link_latency": ListOf(Num()),
        "collective_bandwidth": Maybe(_UNLIMITED), "collective_latency": Maybe(Num()),
        "cores": Maybe(Num(integer=True, minimum=1)), "calibrated": Maybe(Text()),
    },
    optional=frozenset({"collective_bandwidth", "collective_latency", "cores", "calibrated"}),
)

#: What ``Plan.to_dict`` writes (format version 1), key by key.
PLAN_SCHEMA = Record(
    "plan",
    {
        "format": Text(), "version": Num(integer=True), "fingerprint": Text(), "trace_method": Text(),
        "method": Text(), "schedule": _SCHEDULE, "microbatches": Num(integer=True, minimum=1),
        "granularity": Text(("node", "module")), "bottleneck": Num(), "lower_bound": Num(),
        "state_bytes_per_param": Num(), "input_names": ListOf(Text()), "cluster": CLUSTER,
        "stages": ListOf(STAGE), "predictions": ListOf(PREDICTION), "io": ListOf(IO),
        "shared_params": MapOf(ListOf(Num(integer=True))), "param_aliases": MapOf(ListOf(Text())),
        "candidates": ListOf(CANDIDATE), "choice": Text(), "precision": Text(tuple(PRECISIONS)),
        "output_structure": Text(), "layout": Maybe(LAYOUT), "layouts": ListOf(LAYOUT), "checksum": Text(),
        "inference": Maybe(INFERENCE),
    },
    # Written only when they differ from the default (fp32, one tensor out, no layout search, training).
    optional=frozenset({"precision", "output_structure", "layout", "layouts", "inference"}),
)
