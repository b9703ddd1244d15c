"""A GGUF file as a container, read and written with the `gguf` package: opened with one clear line
when it is not a GGUF (or is cut short), and copied (every tensor's bytes and every metadata key as
they are) with string keys added or left out.

KITE's own keys start with `kite.` (`KITE_KEYS`); they are never the model's, so a GGUF that carries
them converts to the same model without them (`kite.model.sources`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kite.errors import BadInput, KiteError

MAGIC = b"GGUF"
KITE_KEYS = "kite."
_ARCHITECTURE = "general.architecture"


def is_kite_key(key: str) -> bool:
    return key.startswith(KITE_KEYS)


def check_gguf(path: str | os.PathLike[str], what: str | None = None) -> Path:
    """`path` is a GGUF file by its first bytes, else BadInput (naming `what`, a flag, when given).
    Reads 4 bytes: cheap enough to check before anything slow."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(MAGIC))
    except FileNotFoundError:
        raise BadInput(f"{name}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{name}: is a folder, expected a .gguf file") from None
    if head != MAGIC:
        seen = "an empty file" if not head else f"its first bytes are {head!r}"
        raise BadInput(f"{name}: not a GGUF file ({seen}; a GGUF file starts with b'GGUF')")
    return path


def open_gguf(path: str | os.PathLike[str], what: str | None = None):
    """A `gguf.GGUFReader` over `path` (memory-mapped: tensors are read when touched). BadInput for
    a file that is not a GGUF, or one cut short or corrupt (the reader's own words in brackets)."""
    from gguf import GGUFReader

    path = check_gguf(path, what)
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as exc:
        name = f"{what} {path}" if what else str(path)
        raise BadInput(f"{name}: corrupt or truncated GGUF file ({exc})") from None


def string_values(reader, prefix: str) -> dict[str, str]:
    """The string-typed metadata values whose keys start with `prefix`, by key."""
    from gguf import GGUFValueType

    return {name: field.contents() for name, field in reader.fields.items()
            if name.startswith(prefix) and field.types == [GGUFValueType.STRING]}


def copy_gguf(reader, dest: str | os.PathLike[str], *, add: Mapping[str, str] | None = None,
              drop: Callable[[str], bool] | None = None) -> int:
    """Write the GGUF `reader` reads to `dest` with the `gguf` package's writer: the same tensors
    (their stored bytes, quantized or not, in order), the same metadata keys, types and values in
    order, the same alignment and byte order; leaving out the keys `drop` says yes to, and adding
    `add`'s string values after the rest. Written atomically (`kite.atomic.atomic_path`); `dest`
    may be the file `reader` reads. Returns the bytes written."""
    from gguf import GGUFValueType, GGUFWriter

    from kite.atomic import atomic_path

    values = [(name, *_value_of(field)) for name, field in reader.fields.items()
              if name != _ARCHITECTURE and not name.startswith("GGUF.") and not (drop and drop(name))]
    with atomic_path(dest) as tmp:
        writer = GGUFWriter(tmp, arch=reader.fields[_ARCHITECTURE].contents(), endianess=reader.endianess)
        try:
            writer.data_alignment = int(reader.alignment)
            for name, value, vtype, sub_type in values:
                writer.add_key_value(name, value, vtype, sub_type=sub_type)
            for key, text in (add or {}).items():
                writer.add_key_value(key, text, GGUFValueType.STRING)
            for t in reader.tensors:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in reader.tensors:
                writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        finally:
            writer.close()
        return tmp.stat().st_size


def _value_of(field) -> tuple[Any, Any, Any]:
    """(value, type, array element type) of a metadata field, as the writer takes them back."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype != GGUFValueType.ARRAY:
        return field.contents(), vtype, None
    # the writer cannot write an empty array, and the reader flattens arrays of arrays
    if len(field.types) != 2:
        what = "an empty array" if len(field.types) == 1 else "an array of arrays"
        raise KiteError(f"cannot copy metadata key {field.name!r}: it holds {what}, which the gguf "
                        f"package's writer does not write")
    return field.contents(), vtype, field.types[1]
