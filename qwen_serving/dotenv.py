"""The repo's `.env`, read with Docker Compose's env-file rules, so one file serves the launchers and Compose.

    python -m qwen_serving.dotenv [FILE]   `export` lines for what FILE sets and the environment does not
                                           (start_server.sh evals them); a bad line exits 2 naming it

The rules (Compose v2, compose-go's dotenv parser; docs.docker.com/compose/env-file/):
- blank lines and lines whose first non-blank character is `#` are ignored; `export ` before a name is dropped;
- a name is letters, digits and `_ . - [ ]`, followed by `=` (or YAML's `:`); a bare name takes the
  environment's value when it has one;
- unquoted values run to the end of the line, cut at the first ` #` (a `#` with no space before it is
  part of the value), trailing blanks trimmed;
- single-quoted values are literal (`\\'` is a quote); double-quoted values expand `\\n \\t \\r \\\\ \\" \\$`
  and friends; both may span lines, and only a comment may follow the closing quote;
- unquoted and double-quoted values interpolate `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`,
  `${VAR:?error}`, `${VAR?error}`, `${VAR:+alt}`, `${VAR+alt}` (nested), `$$` is a `$`; a name is looked
  up in the environment first, then in the lines above it; unset without a default is empty.
Two departures, both refusals of what Compose reads oddly: text after a closing quote (Compose takes
`A="x" B=1` as two assignments) and `=value` with no name. Every line Compose refuses is refused too,
naming the line. The environment always wins over the file (tests/test_dotenv.py checks all of this
against the real Compose binary).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

NAME_CHARS = re.compile(r"[\w.\-\[\]]", re.UNICODE)
INTERPOLATED_NAME = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")
# the backslash escapes a double-quoted value expands (Go's set, as Compose uses it); \0NNN is octal
DOUBLE_QUOTE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                        "\\": "\\", '"': '"'}
BLANK = " \t\v\f\r\x85\xa0"  # whitespace that does not end a line


class DotenvError(ValueError):
    """A line the parser refuses; the message starts with FILE:LINE."""


class _Parser:
    def __init__(self, text: str, source: str, lookup: Mapping[str, str]):
        self.text, self.source, self.lookup = text, source, lookup
        self.pos, self.line = 0, 1
        self.out: dict[str, str] = {}

    def fail(self, message: str, line: int | None = None) -> DotenvError:
        return DotenvError(f"{self.source}:{line or self.line}: {message}")

    def advance(self, n: int) -> str:
        chunk = self.text[self.pos:self.pos + n]
        self.line += chunk.count("\n")
        self.pos += n
        return chunk

    def skip_blanks(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in BLANK:
            self.pos += 1

    def rest_of_line(self) -> str:
        end = self.text.find("\n", self.pos)
        return self.text[self.pos:] if end < 0 else self.text[self.pos:end]

    def parse(self) -> dict[str, str]:
        while True:
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.advance(1)
            if self.pos >= len(self.text):
                return self.out
            if self.text[self.pos] == "#":
                self.advance(len(self.rest_of_line()))
                continue
            self.statement()

    def statement(self) -> None:
        match = re.match(r"export[ \t]+", self.text[self.pos:])
        if match:
            self.advance(match.end())
        start, line = self.pos, self.line
        while self.pos < len(self.text) and self.text[self.pos] not in "=:\n":
            char = self.text[self.pos]
            if char not in BLANK and not NAME_CHARS.fullmatch(char):
                raise self.fail(f"unexpected character {char!r} in variable name {self.rest_of_line()!r}; "
                                "a line is NAME=value, a # comment, or blank")
            self.pos += 1
        key = self.text[start:self.pos].strip(BLANK)
        if " " in key or "\t" in key:
            raise self.fail(f"a variable name cannot contain a space: {key!r}", line)
        if not key:
            raise self.fail("no variable name before '='", line)
        if self.pos >= len(self.text) or self.text[self.pos] == "\n":  # a bare name: inherited
            if key in self.lookup:
                self.out[key] = self.lookup[key]
            return
        self.advance(1)  # '=' or ':'
        self.skip_blanks()
        quote = self.text[self.pos:self.pos + 1]
        self.out[key] = self.quoted(quote) if quote in ("'", '"') else self.unquoted()

    def unquoted(self) -> str:
        raw = self.rest_of_line()
        self.advance(len(raw))
        value = raw.split(" #", 1)[0].rstrip()
        return self.interpolate(value)

    def quoted(self, quote: str) -> str:
        opened = self.line
        self.advance(1)
        chars: list[str] = []
        escaped = False
        while self.pos < len(self.text):
            char = self.advance(1)
            if escaped:
                escaped = False
                chars.append(char if char == quote else "\\" + char)
            elif char == "\\":
                escaped = True
            elif char == quote:
                break
            else:
                chars.append(char)
        else:
            raise self.fail(f"unterminated {quote}-quoted value (opened here)", opened)
        trailing = self.rest_of_line().strip(BLANK)
        if trailing and not trailing.startswith("#"):
            raise self.fail(f"unexpected {trailing!r} after the closing quote; only a # comment may follow it")
        value = "".join(chars)
        return value if quote == "'" else self.interpolate(_expand_escapes(value))

    def lookup_value(self, name: str) -> str | None:
        if name in self.lookup:
            return self.lookup[name]
        return self.out.get(name)

    def interpolate(self, value: str) -> str:
        out, i = [], 0
        while i < len(value):
            char = value[i]
            if char != "$" or i + 1 >= len(value):
                out.append(char)
                i += 1
                continue
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
            elif nxt == "{":
                end = _closing_brace(value, i + 2)
                if end < 0:
                    raise self.fail(f"unterminated ${{...}} in {value!r}")
                out.append(self.braced(value[i + 2:end], value))
                i = end + 1
            else:
                match = INTERPOLATED_NAME.match(value, i + 1)
                if match:
                    out.append(self.lookup_value(match.group()) or "")
                    i = match.end()
                else:  # `$` before anything else is literal
                    out.append("$")
                    i += 1
        return "".join(out)

    def braced(self, body: str, value: str) -> str:
        match = re.fullmatch(r"([_a-zA-Z][_a-zA-Z0-9]*)(?:(:?)([-+?])(.*))?", body, re.S)
        if not match:
            raise self.fail(f"invalid interpolation ${{{body}}} in {value!r}")
        name, colon, op, arg = match.groups()
        current = self.lookup_value(name)
        present = current is not None and (current != "" or not colon)
        if op is None:
            return current or ""
        if op == "-":
            return current if present else self.interpolate(arg)
        if op == "+":
            return self.interpolate(arg) if present else ""
        if not present:  # op == "?"
            reason = self.interpolate(arg)
            raise self.fail(f"required variable {name} is missing a value" + (f": {reason}" if reason else ""))
        return current


def _closing_brace(value: str, start: int) -> int:
    """Index of the `}` closing a `${` whose body starts at `start` (nested `${...}` counted), or -1."""
    depth = 1
    i = start
    while i < len(value):
        if value.startswith("${", i):
            depth += 1
            i += 2
            continue
        if value[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _expand_escapes(value: str) -> str:
    def one(match: re.Match) -> str:
        text = match.group(1)
        if text == "$":
            return "$$"  # a literal dollar, kept from interpolation
        if text[0] == "0":
            return chr(int(text, 8))
        return DOUBLE_QUOTE_ESCAPES[text]

    return re.sub(r"\\([abfnrtv$\"\\]|0[0-7]{0,3})", one, value)


def parse(text: str, lookup: Mapping[str, str] | None = None, source: str = ".env") -> dict[str, str]:
    """NAME -> value for every assignment in `text`; `lookup` (the environment) serves interpolation."""
    return _Parser(text, source, os.environ if lookup is None else lookup).parse()


def read(path: Path, lookup: Mapping[str, str] | None = None) -> dict[str, str]:
    """The file's assignments, or {} when there is no file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    return parse(text, lookup, source=str(path))


def merged(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment over the file: what a launcher sees (a variable already set is never replaced)."""
    environ = os.environ if environ is None else environ
    return {**read(path, environ), **environ}


def environment_or_exit(path: Path) -> dict[str, str]:
    """merged() for a command line: a bad file ends the process with exit 2 and the line it refuses."""
    try:
        return merged(path)
    except DotenvError as e:
        problem = f"{e} (Compose's env-file syntax: NAME=value)"
    except UnicodeDecodeError:
        problem = f"{path} is not UTF-8 text"
    print(f"qwen-serving: {problem}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else Path(__file__).resolve().parents[1] / ".env"
    for name, value in environment_or_exit(path).items():
        if name not in os.environ and re.fullmatch(r"[_a-zA-Z][_a-zA-Z0-9]*", name):
            print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
