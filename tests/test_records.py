"""supervisord_gpu.records behaves as dataclasses does for the subset the package uses.

Each case builds the same class twice, once with the standard dataclasses and once with
records, and compares what an instance does: construction, defaults, factories, repr,
equality, hashing, frozenness, replace() and asdict(). And the read commands' imports must
not load dataclasses (or inspect) behind the records' back: that is what records are for.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from supervisord_gpu import records


def build(lib: Any, frozen: bool) -> type:
    deco = lib.dataclass(frozen=True) if frozen else lib.dataclass

    @deco
    class Point:
        x: int
        y: int = 7
        tags: list = lib.field(default_factory=list)  # type: ignore[type-arg]
        label: str = lib.field(default="p")

        def norm(self) -> int:
            return abs(self.x) + abs(self.y)

    return Point


@pytest.mark.parametrize("frozen", [True, False])
def test_construction_repr_equality_and_defaults_match_dataclasses(frozen: bool) -> None:
    ours, std = build(records, frozen), build(dataclasses, frozen)
    for args, kwargs in [((1,), {}), ((1, 2), {}), ((1,), {"tags": ["a"]}), ((), {"x": 3, "label": "q"})]:
        a, b = ours(*args, **kwargs), std(*args, **kwargs)
        assert repr(a) == repr(b)
        assert (a.x, a.y, a.tags, a.label, a.norm()) == (b.x, b.y, b.tags, b.label, b.norm())
        assert a == ours(*args, **kwargs) and a != ours(99)
    assert ours(1).tags is not ours(1).tags  # a fresh list each time, as default_factory promises
    assert ours.y == std.y == 7 and ours.label == std.label == "p"
    assert hasattr(ours, "tags") == hasattr(std, "tags") and not hasattr(ours, "x")
    assert ours(1) != std(1)  # different classes never compare equal


@pytest.mark.parametrize("bad", [((), {}), ((1, 2, [], "l", 5), {}), ((1,), {"nope": 1}), ((1,), {"x": 2})])
def test_wrong_arguments_are_type_errors_as_with_dataclasses(bad: tuple) -> None:  # type: ignore[type-arg]
    args, kwargs = bad
    with pytest.raises(TypeError):
        build(dataclasses, True)(*args, **kwargs)
    with pytest.raises(TypeError):
        build(records, True)(*args, **kwargs)


def test_frozen_records_refuse_assignment_and_hash_by_value() -> None:
    P = build(records, True)
    p = P(1, tags=())
    with pytest.raises(AttributeError):
        p.x = 2
    with pytest.raises(AttributeError):
        del p.y
    assert hash(p) == hash(P(1, tags=())) and len({p, P(1, tags=())}) == 1


def test_mutable_records_are_assignable_and_unhashable_like_dataclasses() -> None:
    P, S = build(records, False), build(dataclasses, False)
    p = P(1)
    p.x = 5
    assert p.x == 5
    for cls in (P, S):
        with pytest.raises(TypeError):
            hash(cls(1))


def test_replace_and_asdict_match_dataclasses() -> None:
    for lib in (records, dataclasses):
        P = build(lib, True)
        outer = P(1, tags=[P(2), (3, {"k": P(4)})])
        assert lib.replace(outer, y=0).y == 0 and lib.replace(outer, y=0).x == 1
        with pytest.raises(TypeError):
            lib.replace(outer, nope=1)
    ours, std = build(records, True), build(dataclasses, True)
    assert records.asdict(ours(1, tags=[ours(2), (3, {"k": ours(4)})])) == dataclasses.asdict(
        std(1, tags=[std(2), (3, {"k": std(4)})]))


def test_what_records_do_not_support_is_refused_not_built_wrong() -> None:
    with pytest.raises(TypeError):
        @records.dataclass
        class WithPost:
            x: int

            def __post_init__(self) -> None:
                pass
    Base = build(records, False)
    with pytest.raises(TypeError):
        @records.dataclass
        class Child(Base):  # type: ignore[valid-type,misc]
            z: int = 0


def test_the_read_commands_do_not_import_dataclasses_or_inspect() -> None:
    code = ("import sys; import supervisord_gpu.cli.gpusupctl, supervisord_gpu.config.loader, "
            "supervisord_gpu.controller.preflight, supervisord_gpu.checks.preconditions, supervisord_gpu.cli.status_view; "
            "print(sorted(m for m in ('dataclasses', 'inspect') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
