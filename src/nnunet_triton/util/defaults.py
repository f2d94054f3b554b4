"""A dataclass field's default, read where another layer offers the same setting (a command-line flag, a
plan handed on to a spec): the dataclass that uses the value owns it, the others read it from there."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["field_default"]


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (its ``default_factory`` called when it has one).

    Raises:
        KeyError: ``cls`` has no such field, or the field has no default.
    """
    for field in dataclasses.fields(cls):
        if field.name != name:
            continue
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")
