"""Rule errors that point at the file, line and column, and render with the source and a caret."""

from __future__ import annotations

from dataclasses import dataclass

from kite.errors import BadInput


@dataclass(frozen=True, slots=True)
class RuleError:
    """One problem in a rule file. `line` and `col` are 1-based; `length` is what the caret spans."""

    file: str
    line: int
    col: int
    message: str
    source_line: str = ""
    length: int = 1

    @property
    def header(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"

    def render(self) -> str:
        """`file:line:col: message`, then the source line and a caret under the column."""
        if not self.source_line:
            return self.header
        # Keep tabs so the caret lines up under a tab-indented source line.
        pad = "".join(c if c == "\t" else " " for c in self.source_line[: self.col - 1])
        caret = "^" + "~" * max(0, min(self.length, len(self.source_line) - self.col + 1) - 1)
        return f"{self.header}\n    {self.source_line}\n    {pad}{caret}"

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "col": self.col, "message": self.message}


@dataclass(frozen=True, slots=True)
class Span:
    """Where something is written in a rule file: 1-based line and col, length, the line's text."""

    line: int
    col: int
    length: int = 1
    source_line: str = ""

    def error(self, file: str, message: str) -> RuleError:
        return RuleError(file, self.line, self.col, message, self.source_line, self.length)


class RuleSetError(BadInput):
    """A rule file that does not load, with every error found in it (never a half-built set).

    `str()` is the first error's `file:line:col: message`; `report()` renders them all.
    """

    def __init__(self, errors: list[RuleError]):
        if not errors:
            raise ValueError("RuleSetError needs at least one error")
        self.errors = list(errors)
        super().__init__(self.errors[0].header)

    def report(self) -> str:
        n = len(self.errors)
        body = "\n".join(e.render() for e in self.errors)
        return f"{body}\n{n} error{'s' if n != 1 else ''} in {self.errors[0].file}"
