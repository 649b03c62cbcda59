"""A strict reader for one TOML table: typed getters that name the file and the dotted key.

Every getter removes its key; `finish()` turns whatever is left into an "unknown key" error.
So a typo is never silently ignored, and every message points at the exact place to fix.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()
MAX_PORT = 65535


class Table:
    def __init__(self, path: Path | builtins.str, prefix: builtins.str, data: Any) -> None:
        self.path = str(path)
        self.prefix = prefix
        if not isinstance(data, dict):
            raise ConfigError(self.path, prefix, f"must be a table, not {type_name(data)}")
        self._data = dict(data)

    def key(self, name: builtins.str) -> builtins.str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: builtins.str, problem: builtins.str) -> ConfigError:
        return ConfigError(self.path, self.key(name), problem)

    def has(self, name: builtins.str) -> builtins.bool:
        return name in self._data

    def _take(self, name: builtins.str, default: Any) -> Any:
        if name in self._data:
            return self._data.pop(name)
        if default is _MISSING:
            raise self.error(name, "is required")
        return default

    def _typed(self, name: builtins.str, default: Any, kinds: tuple[type, ...], what: builtins.str) -> Any:
        value = self._take(name, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) and bool not in kinds:
            raise self.error(name, f"must be {what}, not a boolean")
        if not isinstance(value, kinds):
            raise self.error(name, f"must be {what}, not {type_name(value)}")
        return value

    def str(self, name: builtins.str, default: Any = _MISSING, choices: tuple[builtins.str, ...] | None = None) -> Any:
        value = self._typed(name, default, (str,), "a string")
        if isinstance(value, str):
            if "\x00" in value:
                raise self.error(name, "must not contain NUL characters")
            if choices is not None and value not in choices:
                raise self.error(name, f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    def bool(self, name: builtins.str, default: Any = _MISSING) -> Any:
        return self._typed(name, default, (bool,), "true or false")

    def int(self, name: builtins.str, default: Any = _MISSING, lo: builtins.int | None = None,
            hi: builtins.int | None = None) -> Any:
        value = self._typed(name, default, (int,), "an integer")
        if isinstance(value, int) and value is not default:
            check_range(self, name, value, lo, hi)
        return value

    def number(self, name: builtins.str, default: Any = _MISSING, lo: float | None = None, hi: float | None = None) -> Any:
        value = self._typed(name, default, (int, float), "a number")
        if isinstance(value, (int, float)) and value is not default:
            if isinstance(value, float) and not math.isfinite(value):
                raise self.error(name, "must be a finite number")
            check_range(self, name, value, lo, hi)
            value = float(value)
        return value

    def port(self, name: builtins.str, default: Any = _MISSING) -> Any:
        return self.int(name, default, lo=1, hi=MAX_PORT)

    def list(self, name: builtins.str, item: Callable[[Any, builtins.str], T], default: Any = _MISSING) -> Any:
        value = self._take(name, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self.error(name, f"must be a list, not {type_name(value)}")
        return tuple(item(v, f"{self.key(name)}[{i}]") for i, v in enumerate(value))

    def table(self, name: builtins.str, required: builtins.bool = False) -> Table:
        value = self._take(name, _MISSING if required else {})
        return Table(self.path, self.key(name), value)

    def raw(self, name: builtins.str, default: Any = _MISSING) -> Any:
        return self._take(name, default)

    def items(self) -> builtins.list[tuple[builtins.str, Any]]:
        """Take every remaining key (for free-form tables such as options and env)."""
        items = list(self._data.items())
        self._data.clear()
        return items

    def finish(self) -> None:
        if self._data:
            name = sorted(self._data)[0]
            raise self.error(name, "unknown key" + _did_you_mean(name))


def check_range(table: Table, name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise table.error(name, f"must be at least {lo}, not {value}")
    if hi is not None and value > hi:
        raise table.error(name, f"must be at most {hi}, not {value}")


def type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)


_KNOWN_TYPOS = {"gpu": "gpus", "tp": "options.tp-size", "model": "model_path", "depends_on": "after"}


def _did_you_mean(name: str) -> str:
    hint = _KNOWN_TYPOS.get(name)
    return f" (did you mean {hint!r}?)" if hint else ""
