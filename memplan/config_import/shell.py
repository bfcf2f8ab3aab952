"""The training command of a bash launch script, read without running anything: the words
Megatron-LM's example scripts (examples/**/*.sh) pass to ``pretrain_gpt.py``.

What bash would do and this reads: comments, line continuations, quotes, variables set in the
script (``TP=2``, ``export X=...``), ``$X`` / ``${X}`` / ``${X:-default}`` / ``${X-default}``
(a variable the script does not set is empty, as in a bare environment; positional arguments
``$1`` ... are not given), arrays (``ARGS=( ... )``, ``ARGS+=( ... )``, ``${ARGS[@]}`` quoted
or not, word-split when unquoted), integer arithmetic ``$((...))``, and ``if``/``elif``/
``else`` and ``case`` decided on those values (``[[ "$A" == x ]]``, ``[ -n "$A" ]``,
``-eq``/``-gt``..., joined by ``||`` / ``&&``). A command substitution ``$(...)`` is never run
(its value is its own text); a loop's body is not run; a test bash would decide on the file
system (``[ -f path ]``) is undecided, and its branches are skipped unless one of them sets a
variable, which is then refused by name.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import re
from dataclasses import dataclass, field

from memplan.errors import MemplanError
from memplan.inputs import too_large

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
# words that open and close a compound command: the reader walks them, never runs them
_CLOSERS = {"if": "fi", "case": "esac", "while": "done", "until": "done", "for": "done"}
# commands whose words are text, not a launch (``echo "... pretrain_gpt.py ..."``)
_TEXT_COMMANDS = {"echo", "printf", "cat", "mkdir", "ls", "test", "["}


def _quotient(a: int, b: int) -> int:
    """bash's / on integers: C's, truncated toward zero (-7 / 2 is -3, Python's // gives -4)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _remainder(a: int, b: int) -> int:
    """bash's %: the sign of the dividend (-7 % 2 is -1, Python's gives 1)."""
    return a - b * _quotient(a, b)


# bash's integer operators, as $((...)) evaluates them
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.FloorDiv: _quotient, ast.Div: _quotient, ast.Mod: _remainder}
# the most words a statement or an array may expand to, and the longest value a variable may
# hold: a script that doubles an array or a string line after line (A=( "${A[@]}" "${A[@]}" ),
# X="$X$X") is refused before it fills memory; a launch command has a few hundred words
MAX_WORDS = 100_000
MAX_VALUE_CHARS = 1_000_000


@dataclass
class Word:
    """One shell word: (text, how) segments, how: "lit" (unquoted text), "q" (quoted text),
    "$" / "q$" (a parameter unquoted / quoted), "((" (arithmetic)."""

    parts: list[tuple[str, str]] = field(default_factory=list)

    def literal(self) -> str:
        return "".join(t for t, how in self.parts if how in ("lit", "q"))


def _lex(text: str, where: str) -> list[object]:
    """Words, "\\n" (a statement's end), "(" / ")" / "|" / "||" / "&&" / ";;"."""
    out: list[object] = []
    i, n = 0, len(text)
    word: Word | None = None

    def end() -> None:
        nonlocal word
        if word is not None:
            out.append(word)
            word = None

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            if text[i + 1] != "\n":
                word = word or Word()
                word.parts.append((text[i + 1], "q"))
            i += 2
            continue
        if c in " \t\r":
            end()
            i += 1
            continue
        if c == "#" and word is None:
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c in "\n;&|()":
            two = text[i:i + 2]
            if c == "(" and word is not None and word.literal().endswith("$"):
                pass  # "$(" is a substitution inside the word, read below
            else:
                end()
                if two in (";;", "||", "&&"):
                    out.append(two)
                    i += 2
                elif c in "\n;":
                    out.append("\n")
                    i += 1
                else:
                    out.append(c)
                    i += 1
                continue
        word = word or Word()
        if c == "'":
            close = text.find("'", i + 1)
            if close < 0:
                raise MemplanError(f"{where}: an unclosed ' quote")
            word.parts.append((text[i + 1:close], "q"))
            i = close + 1
        elif c == '"':
            i = _double(text, i + 1, word, where)
        elif c == "$":
            i = _dollar(text, i, word, quoted=False, where=where)
        else:
            word.parts.append((c, "lit"))
            i += 1
    end()
    return out


def _double(text: str, i: int, word: Word, where: str) -> int:
    """The inside of a double-quoted string from ``i``: text and parameters, quoted."""
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and i + 1 < len(text) and text[i + 1] in '"\\$`\n':
            if text[i + 1] != "\n":
                word.parts.append((text[i + 1], "q"))
            i += 2
        elif c == "$":
            i = _dollar(text, i, word, quoted=True, where=where)
        else:
            word.parts.append((c, "q"))
            i += 1
    raise MemplanError(f"{where}: an unclosed \" quote")


def _matching(text: str, i: int, open_: str, close: str, where: str) -> int:
    """The index just past the ``close`` that matches the ``open_`` at ``i``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    raise MemplanError(f"{where}: an unclosed {open_}")


def _dollar(text: str, i: int, word: Word, quoted: bool, where: str) -> int:
    q = "q" if quoted else ""
    if text.startswith("$((", i):
        j = _matching(text, i + 1, "(", ")", where)
        word.parts.append((text[i + 3:j - 2], "(("))
        return j
    if text.startswith("$(", i):  # never run: its value is its text
        j = _matching(text, i + 1, "(", ")", where)
        word.parts.append((text[i:j], "q"))
        return j
    if text.startswith("${", i):
        j = _matching(text, i + 1, "{", "}", where)
        word.parts.append((text[i + 2:j - 1], q + "$"))
        return j
    m = _NAME.match(text, i + 1)
    if m:
        word.parts.append((m.group(), q + "$"))
        return m.end()
    if i + 1 < len(text) and (text[i + 1].isdigit() or text[i + 1] in "#@*?$!"):
        word.parts.append((text[i + 1], q + "$"))
        return i + 2
    word.parts.append(("$", q or "lit"))
    return i + 1


class _Script:
    def __init__(self, tokens: list[object], where: str) -> None:
        self.tokens, self.where = tokens, where
        self.env: dict[str, str | list[str]] = {}
        self.commands: list[list[str]] = []
        self.stopped = False

    # --- expansion ------------------------------------------------------------------------
    def param(self, expr: str) -> str | list[str]:
        """``${expr}``'s value: a list for ``NAME[@]``."""
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[#@*?$!])(\[[@*]\])?"
                         r"(?:(:?[-=+?])(.*))?", expr, re.S)
        if not m:
            raise MemplanError(f"{self.where}: ${{{expr}}} is a form of expansion memplan "
                               "does not read")
        name, index, op, default = m.groups()
        value = {"#": "0", "@": [], "*": []}.get(name, self.env.get(name))
        if index is None and isinstance(value, list):
            value = value[0] if value else ""  # $ARR is its first element
        empty = value is None or (op is not None and op.startswith(":") and value in ("", []))
        if op is not None and op.lstrip(":") in "-=" and empty:
            value = " ".join(self.expand(w, split=False)[0] for w in _lex(default, self.where)
                             if isinstance(w, Word)) if default else ""
            if op.lstrip(":") == "=":
                self.env[name] = value
        elif op is not None and op.lstrip(":") == "+":
            value = "" if empty else default
        return "" if value is None else value

    def arith(self, expr: str) -> str:
        """``$((expr))``: integers, + - * / %, variables by name."""
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)

        def value(node: ast.AST) -> int:
            if isinstance(node, ast.Constant) and type(node.value) is int:
                return node.value
            if isinstance(node, ast.Name):
                got = self.env.get(node.id, "0") or "0"
                return int(got) if isinstance(got, str) and got.lstrip("-").isdigit() else 0
            if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
                result = _ARITH[type(node.op)](value(node.left), value(node.right))
                if too_large(result):  # past bash's 64-bit integers: left as its text
                    raise ValueError(expr)
                return result
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -value(node.operand)
            raise ValueError(expr)

        try:
            return str(value(ast.parse(text.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            return f"$(({expr}))"  # not evaluated: its text

    def expand(self, word: Word, split: bool = True) -> list[str]:
        """The strings a word becomes: an unquoted parameter's value split at blanks, a quoted
        array's elements one word each."""
        fields: list[str] = [""]
        started = False
        for text, how in word.parts:
            if how in ("lit", "q"):
                fields[-1] += text
                started = True
            elif how == "((":
                fields[-1] += self.arith(text)
                started = True
            else:
                value = self.param(text)
                items = value if isinstance(value, list) else [value]
                if how == "$" and split:
                    items = [" ".join(items)] if items else []
                    pieces = items[0].split() if items else []
                    if not pieces:
                        continue
                    if items[0][:1].isspace() and (fields[-1] or started):
                        fields.append("")
                    fields[-1] += pieces[0]
                    fields.extend(pieces[1:])
                    started = bool(fields[-1]) or started
                    if items[0][-1:].isspace():
                        fields.append("")
                        started = False
                    continue
                if not items:
                    continue
                fields[-1] += items[0]
                fields.extend(items[1:])
                started = True
        out = [f for f in fields if f or started]
        if len(out) > MAX_WORDS:
            raise MemplanError(f"{self.where}: expands to over {MAX_WORDS:,} words")
        return out

    def words(self, tokens: list[object]) -> list[str]:
        out: list[str] = []
        for t in tokens:
            if isinstance(t, Word):
                out.extend(self.expand(t))
                if len(out) > MAX_WORDS:
                    raise MemplanError(f"{self.where}: a statement expands to over "
                                       f"{MAX_WORDS:,} words")
        return out


def training_command(text: str, where: str) -> list[str] | None:
    """The words of the script's last command that runs a ``.py`` file (a launcher and its
    flags before it), expanded as bash would; None when ``text`` runs no such command."""
    script = _Script(_lex(text, where), where)
    try:
        _Runner(script).block(0, len(script.tokens))
    except RecursionError:  # ${a:-${a:-...}} nested thousands deep, or as many nested ifs
        raise MemplanError(f"{where}: nests deeper than memplan reads") from None
    runs = [c for c in script.commands
            if c and c[0] not in _TEXT_COMMANDS and any(w.endswith(".py") for w in c)]
    return runs[-1] if runs else None


class _Runner:
    """Walks the statements: assignments set the environment, commands are recorded, ``if``
    and ``case`` take the branch their test decides."""

    def __init__(self, script: _Script) -> None:
        self.s = script

    def statement_end(self, i: int, stop: int) -> int:
        """The index of the "\\n" ending the statement at ``i`` (an array's "( ... )" spans
        lines)."""
        depth = 0
        while i < stop:
            t = self.s.tokens[i]
            if t == "(":
                depth += 1
            elif t == ")":
                depth = max(depth - 1, 0)
            elif t in ("\n", ";;") and depth == 0:
                return i
            i += 1
        return stop

    def closing(self, i: int, stop: int) -> int:
        """The index of the word closing the compound command opened at ``i``."""
        opener = self.s.tokens[i].literal()
        close = _CLOSERS[opener]
        depth, j = 0, i
        while j < stop:
            t = self.s.tokens[j]
            if isinstance(t, Word) and self._first(j) and t.literal() in _CLOSERS:
                depth += 1
            elif isinstance(t, Word) and self._first(j) and t.literal() in ("fi", "esac",
                                                                              "done"):
                depth -= 1
                if depth == 0:
                    if t.literal() != close:
                        break
                    return j
            j += 1
        raise MemplanError(f"{self.s.where}: '{opener}' without its '{close}'")

    def _first(self, j: int) -> bool:
        """Whether the token at ``j`` begins a statement."""
        prev = self.s.tokens[j - 1] if j else "\n"
        return prev in ("\n", ";;", "&&", "||", ")") or (
            isinstance(prev, Word) and prev.literal() in ("then", "do", "else")
            and self._first(j - 1))

    def block(self, i: int, stop: int) -> None:
        while i < stop and not self.s.stopped:
            t = self.s.tokens[i]
            if not isinstance(t, Word):
                i += 1
                continue
            head = t.literal() if len(t.parts) and all(h == "lit" for _, h in t.parts) else ""
            if head in _CLOSERS:
                close = self.closing(i, stop)
                if head == "if":
                    self.if_(i + 1, close)
                elif head == "case":
                    self.case(i + 1, close)
                else:
                    self.loop(head, i + 1, close)
                i = close + 1
                continue
            end = self.statement_end(i, stop)
            self.simple(i, end)
            i = end + 1

    def simple(self, i: int, end: int) -> None:
        toks = self.s.tokens[i:end]
        if toks and isinstance(toks[0], Word) and toks[0].literal() in (
                "export", "local", "declare", "readonly") and len(toks[0].parts) == len(
                toks[0].literal()):
            toks = toks[1:]
        while toks and isinstance(toks[0], Word):
            m = _ASSIGN.match(toks[0].literal()) if toks[0].parts and \
                toks[0].parts[0][1] == "lit" else None
            if not m:
                break
            name, append = m.group(1), m.group(2) == "+"
            if len(toks) > 1 and toks[1] == "(":  # NAME=( ... )
                close = next((k for k in range(2, len(toks)) if toks[k] == ")"), len(toks))
                items = self.s.words(toks[2:close])
                old = self.s.env.get(name, [])
                old = [old] if isinstance(old, str) else old
                self.s.env[name] = (old + items) if append else items
                toks = toks[close + 1:]
                continue
            value = self._assigned(toks[0], len(m.group()))
            old = self.s.env.get(name, "")
            if append and isinstance(old, list):
                self.s.env[name] = old + [value]
            else:
                self.s.env[name] = (old if isinstance(old, str) else "") + value \
                    if append else value
            toks = toks[1:]
        words = self.s.words(toks)
        if words and words[0] == "exit":
            self.s.stopped = True
        elif words and words[0] == "unset":
            for name in words[1:]:
                self.s.env.pop(name, None)
        elif words and words[0].startswith("--") and self.s.commands:
            # a line of flags after a command whose line ended without a backslash (a
            # comment at its end): read as more of that command, as a list of flags is meant
            self.s.commands[-1].extend(words)
        elif words:
            self.s.commands.append(words)

    def _assigned(self, word: Word, prefix_chars: int) -> str:
        """The value of ``NAME=value`` (no word splitting in an assignment)."""
        parts, skip = [], prefix_chars
        for text, how in word.parts:
            if skip and how == "lit":
                skip -= len(text)
                continue
            parts.append((text, how))
        value = " ".join(self.s.expand(Word(parts), split=False))
        if len(value) > MAX_VALUE_CHARS:
            raise MemplanError(f"{self.s.where}: a variable's value grows past "
                               f"{MAX_VALUE_CHARS:,} characters")
        return value

    def if_(self, i: int, close: int) -> None:
        """``if TEST; then ...; elif TEST; then ...; else ...; fi``: the first branch whose
        test holds; an undecided test skips every branch after it."""
        branches: list[tuple[int, int, int, int]] = []  # (test start, test end, body, end)
        j, test = i, i
        body = None
        depth = 0
        while j < close:
            t = self.s.tokens[j]
            word = t.literal() if isinstance(t, Word) and self._first(j) else None
            if word in _CLOSERS:
                depth += 1
            elif word in ("fi", "esac", "done"):
                depth -= 1
            elif depth == 0 and word == "then":
                body = j + 1
            elif depth == 0 and word in ("elif", "else"):
                branches.append((test, body - 1, body, j))
                test = j + 1 if word == "elif" else -1
                body = j + 1 if word == "else" else None
            j += 1
        branches.append((test, (body or close) - 1, body or close, close))
        for n, (t0, t1, b0, b1) in enumerate(branches):
            held = True if t0 < 0 else self.test(t0, t1)
            if held is None:
                for _, _, c0, c1 in branches[n:]:
                    self.skipped(c0, c1, "a branch of 'if " + self._text(t0, t1) + "'")
                return
            if held:
                self.block(b0, b1)
                return

    def loop(self, head: str, i: int, close: int) -> None:
        """A loop's body is never run: skipped outright when its test fails the first time
        (``while [[ $# -gt 0 ]]`` with no arguments), else refused if it sets a variable."""
        do = next((j for j in range(i, close) if isinstance(self.s.tokens[j], Word)
                   and self._first(j) and self.s.tokens[j].literal() == "do"), close)
        if head in ("while", "until") and self.test(i, do) is (head == "until"):
            return
        self.skipped(do + 1, close, f"the body of a '{head}' loop")

    def case(self, i: int, close: int) -> None:
        """``case WORD in PATTERN) ...;; esac``: the first item whose pattern matches."""
        toks = self.s.tokens
        subject = " ".join(self.s.expand(toks[i], split=False))
        j = i + 1
        while j < close and not (isinstance(toks[j], Word) and toks[j].literal() == "in"):
            j += 1
        j += 1
        while j < close:
            while j < close and toks[j] == "\n":
                j += 1
            patterns: list[str] = []
            while j < close and toks[j] != ")":
                if isinstance(toks[j], Word):
                    patterns += self.s.expand(toks[j], split=False)
                j += 1
            start, depth, k = j + 1, 0, j + 1
            while k < close and not (toks[k] == ";;" and depth == 0):
                if isinstance(toks[k], Word) and self._first(k):
                    depth += toks[k].literal() in _CLOSERS
                    depth -= toks[k].literal() in ("fi", "esac", "done")
                k += 1
            if patterns and any(fnmatch.fnmatchcase(subject, p.lstrip("(")) for p in patterns):
                self.block(start, k)
                return
            j = k + 1

    def test(self, i: int, end: int) -> bool | None:
        """A test's truth, or None when bash would decide it on the file system or a
        command's output."""
        words: list[list[str]] = [[]]
        joins: list[str] = []
        for t in self.s.tokens[i:end]:
            if t in ("||", "&&"):
                joins.append(t)
                words.append([])
            elif isinstance(t, Word):
                words[-1] += self.s.expand(t, split=False)
        result = _condition(words[0])
        for join, part in zip(joins, words[1:]):
            value = _condition(part)
            if join == "||":
                result = True if result is True or value is True else (
                    None if None in (result, value) else False)
            else:
                result = False if result is False or value is False else (
                    None if None in (result, value) else True)
        return result

    def skipped(self, i: int, end: int, what: str) -> None:
        """A body not run: refused when it sets a variable (its value would be a guess)."""
        for j in range(i, end):
            t = self.s.tokens[j]
            if isinstance(t, Word) and self._first(j) and t.parts and t.parts[0][1] == "lit" \
                    and _ASSIGN.match(t.literal()):
                raise MemplanError(f"{self.s.where}: {t.literal().split('=')[0]} is set in "
                                   f"{what}, which memplan cannot decide without running the "
                                   "script: set it in the script, or give the arguments")

    def _text(self, i: int, end: int) -> str:
        return " ".join(" ".join(self.s.expand(t, split=False))
                        for t in self.s.tokens[i:end] if isinstance(t, Word))


def _condition(words: list[str]) -> bool | None:
    """``[ ... ]``, ``[[ ... ]]``, ``test ...``, ``true``/``false``, ``!``."""
    if words and words[0] in ("[", "[[", "test"):
        words = words[1:-1] if words[0] != "test" else words[1:]
    elif words in (["true"], ["false"]):
        return words == ["true"]
    else:
        return None
    negate = bool(words) and words[0] == "!"
    words = words[1:] if negate else words
    value: bool | None = None
    if len(words) == 2 and words[0] in ("-n", "-z"):
        value = bool(words[1]) == (words[0] == "-n")
    elif len(words) == 1:
        value = bool(words[0])
    elif len(words) == 3:
        a, op, b = words
        if op in ("=", "=="):
            value = fnmatch.fnmatchcase(a, b)
        elif op == "!=":
            value = not fnmatch.fnmatchcase(a, b)
        elif op in ("-eq", "-ne", "-gt", "-lt", "-ge", "-le"):
            try:
                x, y = int(a or 0), int(b or 0)
            except ValueError:
                return None
            value = {"-eq": x == y, "-ne": x != y, "-gt": x > y, "-lt": x < y,
                     "-ge": x >= y, "-le": x <= y}[op]
    if value is None:
        return None
    return value != negate
