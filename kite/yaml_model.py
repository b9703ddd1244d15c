"""Read a YAML file into a strict pydantic model; a bad file is one BadInput line with file:line."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from kite.errors import BadInput, KiteError

M = TypeVar("M", bound=BaseModel)


def read_utf8(path: Path, what: str = "file") -> str:
    """The file's text. Missing, a folder, unreadable or not UTF-8: one error naming the line."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}")
    except IsADirectoryError:
        raise BadInput(f"{path}: is a folder, expected a {what}")
    except OSError as exc:
        raise KiteError(f"{path}: cannot read: {exc.strerror}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise BadInput(f"{path}:{line}: not UTF-8 text (byte {exc.start})")


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2), as users expect."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml_tree(path: Path, text: str) -> tuple[yaml.Node | None, Any, dict[str, int]]:
    """The document's node tree, its data and the line of every dotted key (list items by
    index). A syntax error or a mapping key set twice is one BadInput line with file:line:col."""
    loader = YamlLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        context = ""
        if exc.context and exc.problem:
            started = exc.context_mark
            context = f" ({exc.context}" + (
                f" started on line {started.line + 1})" if started and started is not mark
                and started.line != mark.line else ")")
        raise BadInput(f"{where}: YAML syntax error: {exc.problem or exc.context}{context}")
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not readable as YAML: {' '.join(str(exc).split())}")
    finally:
        loader.dispose()
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    continue
                key = prefix + str(k.value)
                line = k.start_mark.line + 1
                if key in lines:
                    raise BadInput(f"{path}:{line}:{k.start_mark.column + 1}: {key} is set twice "
                                   f"(first on line {lines[key]}); keep one")
                lines[key] = line
                walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines.setdefault(prefix + str(i), v.start_mark.line + 1)
                walk(v, f"{prefix}{i}.")

    if root is not None:
        walk(root, "")
    return root, data, lines


def parse_yaml(path: Path, text: str) -> tuple[Any, dict[str, int]]:
    """The document's data and the line of every dotted key (list items by index)."""
    _, data, lines = parse_yaml_tree(path, text)
    return data, lines


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        info = getattr(current, "model_fields", {}).get(part)
        if info is None:
            return []
        ann = info.annotation
        args = getattr(ann, "__args__", ())
        current = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def load_yaml_model(path: str | Path, model: type[M]) -> M:
    """Validate `path` against `model` (which should forbid extra keys)."""
    path = Path(path)
    data, lines = parse_yaml(path, read_utf8(path))
    if data is None:
        data = {}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        line = next((lines[k] for k in (".".join(str(p) for p in loc[:n]) for n in range(len(loc), 0, -1))
                     if k in lines), 0)
        where = f"{path}:{line}" if line else str(path)
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise BadInput(f"{where}: unknown key {key!r}{hint} (allowed: {', '.join(allowed)})") from None
        raise BadInput(f"{where}: {key}: {err['msg']}") from None
