"""Tool calls written as a Python list of calls, `[get_weather(city="Paris", days=2), now()]`: the
"pythonic" format of vLLM's Llama 3.2 / 4 and Gemma 3 tool templates. The calls are read with
`ast` (parsed, never evaluated: only literals are arguments), and `grammar` writes them for
tool_choice "required" or a named function, each argument's value as its schema says.

As the Llama 3.x JSON format, the calls are the whole message: a message that does not start
with `[name(` is content. Each call comes out whole (name, then its arguments as JSON) once the
comma or bracket after it arrives.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re

from mlxfun.errors import InputError
from mlxfun.features import structured
from mlxfun.serve.tools import Args, CallStart, Format, Text, ToolCall, call_id, parameters

OPENERS = ("<|python_tag|>", "<|python_start|>")  # Llama's tags that may open the list
_HEAD = re.compile(r"\[\s*([A-Za-z0-9_.-]*)(\s*)(\(?)")  # "[", then a name and "(" (each maybe still to come)
_CALL = re.compile(r"([A-Za-z0-9_.-]+)\s*\((.*)\)", re.S)
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON's literals, as a grammar writes them


class Parser:
    """Generated text, fed as it comes -> Text, CallStart and Args pieces (as tools.Parser)."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._text = ""  # everything fed
        self._plain = False  # the message is content
        self._pos: int | None = None  # where scanning goes on, once the list has begun
        self._element = 0  # where the list's current element starts
        self._depth = 0  # brackets open ([ ( {), the list's own included
        self._quote = ""  # the quote of the string being read, if any
        self._escaped = False
        self._done = False  # the list has closed: the rest is dropped

    def feed(self, text: str) -> list:
        self._text += text
        if self._plain:
            return [Text(text)] if text else []
        if self._pos is None:
            start = _start(self._text)
            if start is None:
                return []
            if start < 0:
                return self._content()
            self._pos = self._element = start
        return self._scan()

    def close(self) -> list:
        """The end of the text: a last call without its closing bracket still counts; a message
        with no call in it is content."""
        if self._plain:
            return []
        out = []
        if self._pos is not None and not self._done and self._depth == 1 and not self._quote:
            out = self._end_element(len(self._text))
        if not self.calls and not self._plain:
            return self._content()
        return out

    def _content(self) -> list:
        self._plain = True
        return [Text(self._text)] if self._text else []

    def _scan(self) -> list:
        out, s = [], self._text
        while self._pos < len(s) and not self._done and not self._plain:
            c = s[self._pos]
            self._pos += 1
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "\"'":
                self._quote = c
            elif c in "([{":
                self._depth += 1
                if self._depth == 1:
                    self._element = self._pos
            elif c in ")]}":
                if self._depth == 1:  # the list ends
                    out += self._end_element(self._pos - 1)
                    self._done = True
                self._depth -= 1
            elif c == "," and self._depth == 1:
                out += self._end_element(self._pos - 1)
                self._element = self._pos
        return out

    def _end_element(self, end: int) -> list:
        """The element from self._element to `end`: a call, or (the first one) the sign that the
        message is content; a later one that is no call is dropped."""
        text = self._text[self._element:end]
        if not text.strip() and self.calls:  # "[f(), ]": nothing between the comma and the bracket
            return []
        call = read_call(text)
        if call is None:
            return [] if self.calls else self._content()
        self.calls.append(ToolCall(call_id(self.fmt), call[0], call[1]))
        i = len(self.calls) - 1
        return [CallStart(i, self.calls[i].id, call[0]), Args(i, call[1])]


def _start(text: str) -> int | None:
    """Where a message that opens a list of calls has its "[" (after blanks and an opening tag);
    None while the text may still become one; -1 when it is content."""
    t = text.lstrip()
    for tag in OPENERS:
        if t.startswith(tag):
            t = t[len(tag):].lstrip()
            break
        if tag.startswith(t):  # nothing yet, or a tag cut short
            return None
    if not t:
        return None
    m = _HEAD.match(t)
    if m is None or (m.group(3) and not m.group(1)):
        return -1
    if m.group(3):
        return len(text) - len(t)
    return None if m.end() == len(t) else -1


def read_call(text: str) -> tuple[str, str] | None:
    """`name(key=value, ...)` -> (name, the arguments as JSON text); None if `text` is no such
    call (positional arguments, or values that are not literals)."""
    m = _CALL.fullmatch(text.strip())
    if m is None:
        return None
    try:
        node = ast.parse(f"f({m.group(2)})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    try:
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
    except ValueError:
        return None
    return m.group(1), json.dumps(arguments, ensure_ascii=False)


def _literal(node: ast.AST):
    """A literal's value: Python's (strings, numbers, True/False/None, lists, tuples, dicts) or
    JSON's true/false/null; ValueError for anything else (names, calls, operators...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bool, int, float, type(None))):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        value = _JSON_NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple)):
        value = [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                             for k in node.keys):
        value = {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    else:
        raise ValueError("not a literal")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a JSON number")
    return value


# ---- the grammar ----


def grammar(functions: list[dict], parallel: bool, labels: list[str]) -> str:
    """Lark (llguidance's) for a list of one call of any of `functions` (several with
    `parallel`): `[name(a=..., b=...)]`, the keyword arguments in the order of the schema's
    properties, the required ones always, each value as its schema says (written as JSON, which
    `read_call` takes). `labels`: each function's place in the request, for errors."""
    more = ' ("," " " call)*' if parallel else ""
    lines = [f'start: "[" call{more} "]"', "call: " + " | ".join(f"c{i}" for i in range(len(functions)))]
    for i, (f, label) in enumerate(zip(functions, labels)):
        schema = parameters(f)
        props = schema.get("properties") or {}
        for name in props:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise InputError(f"{label}: property {name!r} is not a Python identifier, which this model's "
                                 "(pythonic) tool-call format needs")
        shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # for the properties' $refs
        rules: dict[str, str] = {}
        first = _arguments(i, 0, True, list(props), props, set(schema.get("required", ())), shared, rules)
        lines.append(f"c{i}: " + " ".join(p for p in (json.dumps(f["name"] + "("), first, '")"') if p))
        lines += [f"{name}: {body}" for name, body in rules.items()]
    return "\n".join(lines)


def _arguments(i: int, k: int, first: bool, names: list[str], props: dict, required: set, shared: dict,
               rules: dict) -> str:
    """The rule for the keyword arguments from property k on ("" when none is left); `first`:
    none written yet (no comma before the next one)."""
    if k == len(names):
        return ""
    rule = f"a{i}_{k}_{int(first)}"
    if rule not in rules:
        sub = props[names[k]] if isinstance(props[names[k]], dict) else {}
        value = {**sub, **shared, "x-guidance": structured.JSON_OPTIONS}
        parts = ([] if first else ['", "']) + [f"{json.dumps(names[k] + '=')} %json{json.dumps(value)}"]
        rest = _arguments(i, k + 1, False, names, props, required, shared, rules)
        take = " ".join(parts + ([rest] if rest else []))
        if names[k] in required:
            rules[rule] = take
        else:
            skip = _arguments(i, k + 1, first, names, props, required, shared, rules)
            rules[rule] = f"({take}) | {skip}" if skip else f"({take})?"
    return rule
