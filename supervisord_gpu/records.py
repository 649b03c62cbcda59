"""Record classes: the part of `dataclasses` this package uses, at no import cost.

Why not `dataclasses` itself: importing it loads inspect, ast, dis and tokenize, and every
@dataclass compiles its methods with exec. On the 2-core machine that was ~15 ms of the ~25 ms
the read commands (`gpusupctl gpus`, `check`, `status`) spent in their own imports, for ~45
small classes (bench/gpus_latency.py measures the commands). Type checkers see the standard
`dataclasses` (the TYPE_CHECKING branch), so every constructor call stays checked; at run time
the decorator gives the class the same __init__ (positional or keyword, defaults, factories),
__repr__, __eq__, __hash__ (frozen records) and frozenness, from its annotations.

The subset: @dataclass and @dataclass(frozen=True); field(default=...) and
field(default_factory=...); replace(); asdict(). Nothing inherits from a record, and no record
has __post_init__, InitVar or ClassVar fields: the decorator refuses a class that would need
them rather than build it wrong. A method the class defines itself is kept, as dataclasses does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataclasses import FrozenInstanceError, asdict, dataclass, field, replace
else:
    _MISSING = object()

    class FrozenInstanceError(AttributeError):
        """Assignment to a field of a frozen record."""

    class _Field:
        __slots__ = ("default", "default_factory")

        def __init__(self, default: Any, default_factory: Any) -> None:
            self.default = default
            self.default_factory = default_factory

    def field(*, default: Any = _MISSING, default_factory: Any = _MISSING) -> Any:
        if default is not _MISSING and default_factory is not _MISSING:
            raise ValueError("cannot specify both default and default_factory")
        return _Field(default, default_factory)

    def dataclass(cls: type | None = None, /, *, frozen: bool = False) -> Any:
        if cls is None:
            return lambda c: _build(c, frozen)
        return _build(cls, frozen)

    def _build(cls: type, frozen: bool) -> type:
        for base in cls.__mro__[1:]:
            if "__record_fields__" in base.__dict__:
                raise TypeError(f"{cls.__qualname__}: records do not inherit from records")
        if "__post_init__" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__}: __post_init__ is not supported")
        names: list[str] = []
        defaults: dict[str, Any] = {}
        factories: dict[str, Any] = {}
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            text = annotation if isinstance(annotation, str) else repr(annotation)
            if "ClassVar" in text or "InitVar" in text:
                raise TypeError(f"{cls.__qualname__}.{name}: ClassVar and InitVar are not supported")
            names.append(name)
            value = cls.__dict__.get(name, _MISSING)
            if isinstance(value, _Field):
                if value.default_factory is not _MISSING:
                    factories[name] = value.default_factory
                    delattr(cls, name)
                    continue
                value = value.default
                if value is _MISSING:
                    delattr(cls, name)
                    continue
                setattr(cls, name, value)
            if value is not _MISSING:
                defaults[name] = value
        order = tuple(names)
        known = frozenset(order)
        title = cls.__qualname__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) > len(order):
                raise TypeError(f"{title}() takes {len(order)} positional arguments but {len(args)} were given")
            values = dict(zip(order, args, strict=False))  # fewer args than fields: the rest by keyword or default
            for key, value in kwargs.items():
                if key not in known:
                    raise TypeError(f"{title}() got an unexpected keyword argument {key!r}")
                if key in values:
                    raise TypeError(f"{title}() got multiple values for argument {key!r}")
                values[key] = value
            state = self.__dict__
            for name in order:
                if name in values:
                    state[name] = values[name]
                elif name in defaults:
                    state[name] = defaults[name]
                elif name in factories:
                    state[name] = factories[name]()
                else:
                    raise TypeError(f"{title}() missing required argument: {name!r}")

        def __repr__(self: Any) -> str:
            return f"{type(self).__qualname__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in order) + ")"

        def __eq__(self: Any, other: object) -> bool:
            if other.__class__ is not self.__class__:
                return NotImplemented
            return all(getattr(self, n) == getattr(other, n) for n in order)

        methods: dict[str, Any] = {"__init__": __init__, "__repr__": __repr__, "__eq__": __eq__}
        if frozen:
            def __setattr__(self: Any, name: str, value: Any) -> None:
                raise FrozenInstanceError(f"cannot assign to field {name!r}")

            def __delattr__(self: Any, name: str) -> None:
                raise FrozenInstanceError(f"cannot delete field {name!r}")

            def __hash__(self: Any) -> int:
                return hash(tuple(getattr(self, n) for n in order))

            methods.update(__setattr__=__setattr__, __delattr__=__delattr__, __hash__=__hash__)
        elif "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
            methods["__hash__"] = None  # mutable and compared by value: unhashable, as dataclasses does
        for name, method in methods.items():
            if name == "__hash__" or name not in cls.__dict__:
                if method is not None:
                    method.__qualname__ = f"{title}.{name}"
                setattr(cls, name, method)
        cls.__record_fields__ = order  # type: ignore[attr-defined]
        cls.__match_args__ = order  # type: ignore[attr-defined]
        return cls

    def _fields_of(obj: Any) -> tuple[str, ...]:
        try:
            return type(obj).__record_fields__  # type: ignore[no-any-return]
        except AttributeError:
            raise TypeError(f"{type(obj).__qualname__} is not a record") from None

    def replace(obj: Any, /, **changes: Any) -> Any:
        """A copy of the record with some fields changed (an unknown name is a TypeError)."""
        return type(obj)(**{n: getattr(obj, n) for n in _fields_of(obj)} | changes)

    def asdict(obj: Any) -> dict[str, Any]:
        """The record as plain dicts and lists, recursively (for JSON)."""
        return {n: _plain(getattr(obj, n)) for n in _fields_of(obj)}

    def _plain(value: Any) -> Any:
        if hasattr(type(value), "__record_fields__"):
            return asdict(value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple keeps its type
            return type(value)(*(_plain(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(_plain(v) for v in value)
        if isinstance(value, dict):
            return type(value)((_plain(k), _plain(v)) for k, v in value.items())
        return value


__all__ = ["FrozenInstanceError", "asdict", "dataclass", "field", "replace"]
