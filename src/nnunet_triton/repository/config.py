"""The ``config.pbtxt`` of a model folder, read (and its text written) in one place.

:func:`read_config` parses a ``config.pbtxt`` with ``text_format`` into Triton's ``ModelConfig`` message and
returns :class:`ModelConfigInfo`, the facts the launchers, probes and rollouts use (backend, instances,
first input, parameters); :func:`write_config_text` replaces one atomically. This is the only module that
opens a ``config.pbtxt`` (rendering a config from a typed spec is the builder's:
``nnunet_triton.builder.config_gen``); :class:`~nnunet_triton.repository.ModelRepository` reads and writes
through it. The server images carry neither protobuf nor tritonclient, so where they are missing (the
container's entry point computing its thread budget, the health probe) the same tree comes from a
schema-less reader of the protobuf text format built on the standard library's tokenizer; a test checks
both give the same tree. Standard library only at import time (Python 3.10 in the images).
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nnunet_triton.io_names import MODEL_CONFIG_FILE
from nnunet_triton.util.durable import write_text_atomic

__all__ = [
    "ConfigTree",
    "ModelConfigInfo",
    "parse_config",
    "config_tree",
    "read_config",
    "read_config_text",
    "write_config_text",
]

# --- reading -------------------------------------------------------------------------------------------

# A config tree: every field present maps to the list of its values in text order (one for a singular
# field); a message value is a tree, an enum its name, a map entry a tree of "key" and "value".
ConfigTree = dict[str, list[Any]]


@dataclass(frozen=True)
class ModelConfigInfo:
    """What the project reads back from one ``config.pbtxt`` (fields absent from the text: their defaults)."""

    name: str
    backend: str | None = None
    platform: str | None = None
    max_batch_size: int = 0
    default_model_filename: str | None = None
    instance_groups: tuple[tuple[int, str], ...] = ()  # (count, kind) per ``instance_group``
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, dims) per input, in order
    parameters: Mapping[str, str] = field(default_factory=dict)  # key -> string_value

    @property
    def is_ensemble(self) -> bool:
        return self.platform == "ensemble"

    @property
    def on_gpu(self) -> bool:
        return any(kind == "KIND_GPU" for _, kind in self.instance_groups)

    @property
    def instance_count(self) -> int:
        """Instances Triton creates (one per group entry's ``count``; one when the config has no group).
        A ``KIND_GPU`` group counts once, not once per visible GPU."""
        return sum(count for count, _ in self.instance_groups) if self.instance_groups else 1

    @property
    def first_input_dims(self) -> tuple[int, ...]:
        return self.inputs[0][1] if self.inputs else ()

    @classmethod
    def from_tree(cls, tree: ConfigTree, *, default_name: str = "") -> ModelConfigInfo:
        def one(node: ConfigTree, key: str, default: Any = None) -> Any:
            values = node.get(key)
            return values[-1] if values else default

        return cls(
            name=str(one(tree, "name", "") or default_name),
            backend=one(tree, "backend") or None,
            platform=one(tree, "platform") or None,
            max_batch_size=int(one(tree, "max_batch_size", 0)),
            default_model_filename=one(tree, "default_model_filename") or None,
            instance_groups=tuple((int(one(g, "count", 1)), str(one(g, "kind", "KIND_AUTO")))
                                  for g in tree.get("instance_group", ())),
            inputs=tuple((str(one(t, "name", "")), tuple(int(d) for d in t.get("dims", ())))
                         for t in tree.get("input", ())),
            parameters={str(one(p, "key", "")): str(one(one(p, "value", {}), "string_value", ""))
                        for p in tree.get("parameters", ())},
        )


def _proto_tree(message: Any) -> ConfigTree:
    """The tree of a parsed ``ModelConfig`` (protobuf is imported by :func:`config_tree`, with a fallback)."""

    def value_of(descriptor: Any, value: Any) -> Any:
        if descriptor.message_type is not None:
            return _proto_tree(value)
        if descriptor.enum_type is not None:
            return descriptor.enum_type.values_by_number[value].name
        return value

    tree: ConfigTree = {}
    for descriptor, value in message.ListFields():
        entry = descriptor.message_type
        if entry is not None and entry.GetOptions().map_entry:
            value_field = entry.fields_by_name["value"]
            tree[descriptor.name] = [{"key": [key], "value": [value_of(value_field, value[key])]}
                                     for key in sorted(value)]
        elif descriptor.label == descriptor.LABEL_REPEATED:
            tree[descriptor.name] = [value_of(descriptor, v) for v in value]
        else:
            tree[descriptor.name] = [value_of(descriptor, value)]
    return tree


def _text_tokens(text: str) -> Iterator[tokenize.TokenInfo]:
    # inside one outer brace Python's tokenizer ignores indentation and line ends; its names, numbers,
    # quoted strings (C escapes), operators and '#' comments are the protobuf text format's tokens
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    tokens = tokenize.generate_tokens(io.StringIO("{" + text + "\n}").readline)
    yield from (t for t in tokens if t.type not in skip)


class _TextReader:
    """Schema-less reader of the protobuf text format (where protobuf is not installed)."""

    def __init__(self, text: str) -> None:
        self._tokens = list(_text_tokens(text))[1:-1]
        self._at = 0

    def _peek(self) -> str | None:
        return self._tokens[self._at].string if self._at < len(self._tokens) else None

    def _next(self) -> tokenize.TokenInfo:
        if self._at >= len(self._tokens):
            raise ValueError("unexpected end of text")
        self._at += 1
        return self._tokens[self._at - 1]

    def message(self, end: str | None = None) -> ConfigTree:
        tree: ConfigTree = {}
        while self._peek() != end:
            name = self._next()
            if name.type != tokenize.NAME:
                raise ValueError(f"line {name.start[0]}: expected a field name, got {name.string!r}")
            if self._peek() == ":":
                self._next()
            if self._peek() == "[":
                self._next()
                while self._peek() != "]":
                    tree.setdefault(name.string, []).append(self._value())
                    if self._peek() == ",":
                        self._next()
                self._next()
            else:
                tree.setdefault(name.string, []).append(self._value())
            if self._peek() in (",", ";"):
                self._next()
        if end is not None:
            self._next()
        return tree

    def _value(self) -> Any:
        token = self._next()
        if token.string in ("{", "<"):
            return self.message("}" if token.string == "{" else ">")
        sign = 1
        if token.string == "-":
            sign, token = -1, self._next()
        if token.type == tokenize.NUMBER:
            return sign * ast.literal_eval(token.string)
        if token.type == tokenize.STRING:
            parts = [ast.literal_eval(token.string)]
            while self._at < len(self._tokens) and self._tokens[self._at].type == tokenize.STRING:
                parts.append(ast.literal_eval(self._next().string))
            return "".join(parts)
        if token.type == tokenize.NAME:
            if token.string.lower() in ("inf", "infinity", "nan"):
                return sign * float(token.string)
            if token.string in ("true", "True", "t"):
                return True
            if token.string in ("false", "False", "f"):
                return False
            return token.string
        raise ValueError(f"line {token.start[0]}: unexpected {token.string!r}")


def config_tree(text: str) -> ConfigTree:
    """The :data:`ConfigTree` of a ``config.pbtxt`` text: through Triton's ``ModelConfig`` protobuf message
    when tritonclient is installed (fields it does not know are skipped), else schema-less.

    Raises:
        ValueError: ``text`` is not a model config (names the parse error).
    """
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:  # the server images: no protobuf there
        try:
            return _TextReader(text).message()
        except (ValueError, SyntaxError, tokenize.TokenError) as exc:
            raise ValueError(f"not a Triton model config: {exc}") from None
    try:
        message = text_format.Parse(text, model_config_pb2.ModelConfig(), allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise ValueError(f"not a Triton model config: {exc}") from None
    return _proto_tree(message)


def parse_config(text: str, *, default_name: str = "") -> ModelConfigInfo:
    """The :class:`ModelConfigInfo` of a ``config.pbtxt`` text (``default_name`` when it names no model).

    Raises:
        ValueError: ``text`` is not a model config.
    """
    return ModelConfigInfo.from_tree(config_tree(text), default_name=default_name)


def read_config_text(model_folder: str | Path) -> str:
    """The text of ``<model_folder>/config.pbtxt`` (OSError when it cannot be read)."""
    return (Path(model_folder) / MODEL_CONFIG_FILE).read_text()


def read_config(model_folder: str | Path) -> ModelConfigInfo:
    """Parse ``<model_folder>/config.pbtxt`` (a config naming no model gets the folder's name).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a model config (names the file).
    """
    try:
        return parse_config(read_config_text(model_folder), default_name=Path(model_folder).name)
    except ValueError as exc:
        raise ValueError(f"{str(Path(model_folder) / MODEL_CONFIG_FILE)!r}: {exc}") from None


def write_config_text(model_folder: str | Path, text: str) -> Path:
    """Write ``text`` as ``<model_folder>/config.pbtxt`` (creating ``model_folder``), replaced atomically."""
    path = Path(model_folder) / MODEL_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    return path
