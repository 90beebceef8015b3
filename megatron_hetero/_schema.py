"""Strict conversion between plain YAML data and the dataclass trees of plans and inventories.

Unknown keys, missing fields and wrong types raise :class:`SchemaError` with the field path.
A field is optional exactly when its dataclass field has a default. ``bool`` is never accepted
for ``int``/``float`` and ``int`` is accepted for ``float`` (YAML writes ``2.0`` as ``2.0``, a
hand-edit may write ``2``), as is exponent notation without a dot (``5e1``), which PyYAML reads
as a string.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from .errors import Described, SchemaError
from .limits import check_quantity

__all__ = ["from_data", "to_data", "read_yaml", "write_yaml", "OMIT_DEFAULT"]

OMIT_DEFAULT = {"omit_default": True}
"""Field metadata: :func:`to_data` leaves the field out while it holds its default."""

_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)")
"""Exponent numbers without a dot, which YAML 1.2 reads as floats and PyYAML as strings."""


MOST_VALUES = 1_000_000
"""The most values (mappings, lists and scalars, each alias counted as often as it is used) a
document may hold: far beyond any plan, inventory, model or profile, and a bound on what an
alias bomb (a few lines of anchors that expand to billions of values) costs to refuse."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently), and turns a scalar its constructors cannot read (``!!int`` with no
    digits, ``!!timestamp x``, an integer of more than 4300 digits) into a YAML error at the
    scalar."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, IndexError, AttributeError, OverflowError) as exc:
            value = node.value if isinstance(node.value, str) else ""
            shown = repr(value) if len(value) <= 40 else repr(value[:37]) + "..."
            raise yaml.constructor.ConstructorError(
                None, None, f"{shown}, which cannot be read as !!{node.tag.rsplit(':', 1)[-1]}",
                node.start_mark) from None

    def construct_document(self, node):
        try:  # a set, a mapping or a list is built by a generator run from here
            return super().construct_document(node)
        except (ValueError, TypeError, IndexError, AttributeError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(None, None, f"a value that cannot be read "
                                                    f"({exc})", node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):  # !!set or !!omap on a scalar or a list
            raise yaml.constructor.ConstructorError(
                None, None, f"expected a mapping node, but found {node.id}", node.start_mark)
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _MergeKey(key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first is not None:
                raise _DuplicateKey(key, first.start_mark, key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


class _MergeKey(Exception):
    def __init__(self, mark):
        super().__init__("<<")
        self.mark = mark


class _DuplicateKey(Exception):
    def __init__(self, key, first, second):
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file strictly; a missing or unreadable file, bytes that are not UTF-8, a
    syntax error or a key given twice becomes a :class:`SchemaError`."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SchemaError(str(path), "", exc.strerror, "a readable YAML file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(str(path), f"byte {exc.start}",
                          Described(f"the byte 0x{raw[exc.start]:02x}, which is not UTF-8"),
                          "a UTF-8 text file") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as exc:
        raise SchemaError(str(path), f"line {exc.second.line + 1}",
                          Described(f"the key {exc.key!r} a second time (first on line "
                                    f"{exc.first.line + 1})"),
                          "each key once in a mapping") from None
    except _MergeKey as exc:
        raise SchemaError(str(path), f"line {exc.mark.line + 1}, column {exc.mark.column + 1}",
                          Described("a YAML merge key (<<)"),
                          "each key written out (a merge key hides which value wins, and YAML "
                          "1.2 has none)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SchemaError(str(path), where, getattr(exc, "problem", str(exc)), "valid YAML") from None
    except RecursionError:
        raise SchemaError(str(path), "", Described("nesting too deep to read"),
                          "a plan, inventory, model or profile document") from None
    _count_values(data, str(path))
    return data


def _count_values(data: Any, source: str) -> None:
    """Refuse a document of more than :data:`MOST_VALUES` values once its aliases are
    expanded, or one that holds itself (``&a [*a]``). Each distinct object is visited once."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        obj, done = stack.pop()
        if not isinstance(obj, (dict, list)):
            continue
        key = id(obj)
        children = list(obj.values()) + list(obj) if isinstance(obj, dict) else obj
        if done:
            open_ids.discard(key)
            total = len(children) + sum(sizes.get(id(c), 0) for c in children)
            sizes[key] = total
            if total > MOST_VALUES:
                raise SchemaError(source, "", Described(f"more than {MOST_VALUES:,} values "
                                                        "(aliases expanded)"),
                                  "a plan, inventory, model or profile document") from None
            continue
        if key in sizes:
            continue
        if key in open_ids:
            raise SchemaError(source, "", Described("a value that contains itself (an alias "
                                                    "inside its own anchor)"),
                              "a document without cycles")
        open_ids.add(key)
        stack.append((obj, True))
        stack.extend((c, False) for c in children if isinstance(c, (dict, list)))


def write_yaml(data: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))


def from_data(cls: type, data: Any, *, source: str, path: str = "") -> Any:
    """Build ``cls`` (a dataclass, or any supported type hint) from plain data, strictly."""
    return _convert(cls, data, source, path)


def to_data(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for ``obj``; fields equal to ``None`` are left out, as
    are fields marked :data:`OMIT_DEFAULT` that hold their default (keys added to a format later:
    files that do not use them are written as before)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or f.metadata.get("internal"):
                continue
            if f.metadata.get("omit_default") and value == f.default:
                continue
            out[f.name] = to_data(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    return obj


def _join(path: str, key: str) -> str:
    """``path.key``; a key that is empty, has a line break or other unprintable character, or
    leading or trailing space is quoted, so that a message stays one readable line."""
    if not key or not key.isprintable() or key.strip() != key:
        key = repr(key)
    return f"{path}.{key}" if path else key


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        return f"a mapping of names to {_describe(typing.get_args(hint)[1])}"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint) if a is not type(None))
    if dataclasses.is_dataclass(hint):
        # a file schema may keep the name its messages had (``SCHEMA_NAME``)
        return f"a mapping ({getattr(hint, 'SCHEMA_NAME', hint.__name__)})"
    return str(hint)


def _convert(hint: Any, data: Any, source: str, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if data is None and len(options) < len(typing.get_args(hint)):
            return None
        errors = []
        for option in options:
            try:
                return _convert(option, data, source, path)
            except SchemaError as exc:
                errors.append(exc)
        finite = [e for e in errors if e.expected == "a finite number"]
        if len(errors) == 1:  # X | None given: X's own error names the field inside it
            raise errors[0]
        raise finite[0] if finite else SchemaError(source, path, data, _describe(hint))
    if dataclasses.is_dataclass(hint):
        return _convert_dataclass(hint, data, source, path)
    if origin is Literal:
        if data in typing.get_args(hint) and not isinstance(data, bool):
            return data
        raise SchemaError(source, path, data, _describe(hint))
    if origin in (list, tuple):
        if not isinstance(data, list):
            raise SchemaError(source, path, data, _describe(hint))
        (item,) = typing.get_args(hint)[:1]
        return [_convert(item, v, source, f"{path}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise SchemaError(source, path, data, _describe(hint))
        _, value_hint = typing.get_args(hint)
        out = {}
        for k, v in data.items():
            if not isinstance(k, str):
                raise SchemaError(source, _join(path, str(k)), k, "a string key")
            out[k] = _convert(value_hint, v, source, _join(path, k))
        return out
    if hint is bool:
        if isinstance(data, bool):
            return data
    elif hint is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
    elif hint is float:
        value = None
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            value = float(data) if abs(data) < 1e300 else math.inf
        elif isinstance(data, str) and _YAML12_FLOAT.fullmatch(data):
            value = float(data)  # PyYAML (YAML 1.1) reads 5e1 and 1e-3 as strings; YAML 1.2 does not
        if value is not None:
            if math.isfinite(value):
                return value
            raise SchemaError(source, path, data, "a finite number")
    elif hint is str:
        if isinstance(data, str):
            return data
    elif hint is Any:
        return data
    else:
        raise TypeError(f"unsupported schema type {hint!r} at {path}")  # a bug, not user input
    raise SchemaError(source, path, data, _describe(hint))


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """The type hints of ``cls`` and its fields read from a file (resolving the hints costs
    more than converting a small mapping, and they never change)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)
                                        if f.init and not f.metadata.get("internal")}


def _convert_dataclass(cls: type, data: Any, source: str, path: str) -> Any:
    if not isinstance(data, dict):
        found = Described("an empty document") if data is None and not path else data
        raise SchemaError(source, path, found, _describe(cls))
    hints, fields = _fields(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise SchemaError(
            source, _join(path, str(unknown[0])), Described("an unknown key"), "one of " + ", ".join(fields)
        )
    kwargs = {}
    for name, f in fields.items():
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if name not in data:
            if not has_default:
                raise SchemaError(source, _join(path, name), Described("nothing (the key is missing)"), _describe(hints[name]))
            continue
        kwargs[name] = _convert(hints[name], data[name], source, _join(path, name))
    try:
        obj = cls(**kwargs)
    except SchemaError as exc:
        # __post_init__ checks report paths relative to the object; anchor them here.
        raise SchemaError(source, _join(path, exc.path) if exc.path != "<root>" else path,
                          exc.found, exc.expected) from None
    for name, f in fields.items():  # after the class's own checks, whose words come first
        kind, value = f.metadata.get("quantity"), kwargs.get(name)
        if kind and isinstance(value, (int, float)) and not isinstance(value, bool):
            check_quantity(kind, value, source=source, path=_join(path, name))
    return obj
