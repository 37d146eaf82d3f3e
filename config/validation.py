"""Checking one config value against its field's declared type and bounds, with a message
that names the dotted key and what is allowed. Pure (msgspec only)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec


class ConfigError(ValueError):
    """An invalid configuration; the message names the dotted key and what is allowed.

    `key` is the dotted key at fault ("" when the error is not about one key).
    """

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(f"config error: {message}")
        self.key = key


@functools.cache
def field_types(cls: type[msgspec.Struct]) -> dict[str, msgspec.inspect.Type]:
    """Field name -> msgspec type info (with constraints) of a config struct, in order."""
    return {f.name: f.type for f in msgspec.inspect.type_info(cls).fields}


def _bounds(t: msgspec.inspect.IntType | msgspec.inspect.FloatType) -> str:
    ops = ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt))
    return " and ".join(f"{op} {bound}" for op, bound in ops if bound is not None)


def _within(t: msgspec.inspect.IntType | msgspec.inspect.FloatType, v: float) -> bool:
    return (
        (t.ge is None or v >= t.ge)
        and (t.gt is None or v > t.gt)
        and (t.le is None or v <= t.le)
        and (t.lt is None or v < t.lt)
    )


def _type_error(t: msgspec.inspect.Type, value: Any) -> str | None:
    """What `value` must be to have type `t`, or None when its type is right."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(t, msgspec.inspect.IntType) and not (is_number and isinstance(value, int)):
        return f"an integer {_bounds(t)}".rstrip()
    if isinstance(t, msgspec.inspect.FloatType) and not is_number:
        return f"a number {_bounds(t)}".rstrip()
    if isinstance(t, msgspec.inspect.StrType) and not isinstance(value, str):
        return "a string"
    if isinstance(t, msgspec.inspect.BoolType) and not isinstance(value, bool):
        return "true or false"
    if isinstance(t, msgspec.inspect.StructType) and not isinstance(value, t.cls):
        return f"a {t.cls.__name__} (a table)"
    return None


def _range_error(t: msgspec.inspect.Type, value: Any) -> str | None:
    """What `value` (of the right type) must be to satisfy `t`'s constraints, or None."""
    if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
        return None if _within(t, value) else _bounds(t)
    if isinstance(t, msgspec.inspect.StrType) and len(value) < (t.min_length or 0):
        return f"a string of at least {t.min_length} character(s)"
    if isinstance(t, msgspec.inspect.LiteralType):
        # `16.0 in (8, 16)` and `True in (0, 1)` are True in Python; demand the exact type.
        if value in t.values and any(type(value) is type(v) for v in t.values):
            return None
        return "one of " + ", ".join(repr(v) for v in t.values)
    return None


def check_field(cls: type[msgspec.Struct], name: str, value: Any) -> None:
    """Raise ConfigError unless `value` is a valid value for field `name` of `cls`.

    The message reads "config error: <section>.<name> must be <constraint>, got <value>".
    """
    t = field_types(cls)[name]
    problem = _type_error(t, value) or _range_error(t, value)
    if problem is not None:
        key = f"{cls.section}.{name}" if cls.section else name
        raise ConfigError(f"{key} must be {problem}, got {value!r}", key=key)
