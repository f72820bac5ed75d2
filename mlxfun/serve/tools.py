"""Tool calling for chat: the tools through the model's chat template, a grammar that makes the
model call one, and its text read back as OpenAI `tool_calls`.

Each family writes its calls its own way (`Format`), found from the chat template: Llama 3.x a
bare JSON object `{"name": ..., "parameters": {...}}`, Qwen2/3 (and Hermes-style templates)
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, Mistral `[TOOL_CALLS] [{"name":
..., "arguments": {...}}]` (Nemo's without the space), Phi-4-mini `functools[{...}, ...]`, and
vLLM's pythonic templates (Llama 3.2 / 4, Gemma 3) a Python list of calls `[get_weather(city=
"Paris")]` (`pythonic.py`). tool_choice "auto" lets the model choose and reads its text after
the fact; "required" and a named function constrain it with a grammar (`prepare`) that writes
exactly that format, so the same parser (`reader`) reads both. "none" renders no tools and reads nothing.

The parser works on text as it streams: content flows out until a call opens, then each call
comes out as its name and then its arguments (the model's JSON text), piece by piece; the
whole answer (`parse`) is the same parser fed everything at once, so a streamed answer
reassembles into the same calls.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import NamedTuple

from mlxfun.engine import options
from mlxfun.errors import InputError
from mlxfun.features import structured
from mlxfun.model.tokenizer import Tokenizer


class Format(NamedTuple):
    """How one family writes tool calls: what opens them (for the parser), and the text around
    them (for the grammar)."""

    name: str
    opens: str | None  # the text that opens the calls; None: the message itself is a JSON call
    head: str  # before the first call
    prefix: str  # before each call
    suffix: str  # after each call
    sep: str | None  # between calls; None: one call at most
    tail: str  # after the last call
    args_key: str  # the call's key for its arguments
    id_chars: int  # tool call ids: 0 for "call_" + 24 hex digits, n for n letters and digits (Mistral's 9)
    python: bool = False  # the calls are a Python list of calls (pythonic.py reads and writes them)


LLAMA3 = Format("llama3_json", None, "", "", "", None, "", "parameters", 0)
QWEN = Format("qwen", "<tool_call>", "", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments", 0)
MISTRAL = Format("mistral", "[TOOL_CALLS]", "[TOOL_CALLS] [", "", "", ", ", "]", "arguments", 9)
MISTRAL_NEMO = MISTRAL._replace(head="[TOOL_CALLS][")  # Nemo's template: no space before the list
PHI4 = Format("phi4_mini", "functools[", "functools[", "", "", ", ", "]", "arguments", 0)
PYTHONIC = Format("pythonic", None, "[", "", "", ", ", "]", "", 0, python=True)

# Texts that are one (special) token in the families' vocabularies: llguidance matches those as
# tokens only, so the grammar names them by id.
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
_PYTHONIC_HINT = re.compile(r"\[func_name1\(")  # the example call the pythonic templates show the model


def detect(tokenizer: Tokenizer) -> Format:
    """The tool-call format of the model's chat template; InputError when it renders no tools or
    writes calls in a format we do not read."""
    template = tokenizer.chat_template or ""
    if not re.search(r"\btools\b", template):
        raise InputError("tools: this model's chat template does not render tools" if template
                         else "tools: this model has no chat template")
    if "[TOOL_CALLS]" in template:
        return MISTRAL_NEMO if "[TOOL_CALLS][" in template else MISTRAL
    if "<function=" in template:  # Qwen3-Coder: XML inside <tool_call>
        raise InputError("tools: this model's chat template writes tool calls as XML (<function=...>), which we "
                         "do not read")
    if "<tool_call>" in template:
        return QWEN
    if "functools[" in template:
        return PHI4
    if _PYTHONIC_HINT.search(template):
        return PYTHONIC
    if "<|start_header_id|>" in template:
        return LLAMA3
    raise InputError("tools: this model's chat template writes tool calls in a format we do not read "
                     "(we read Llama 3.x JSON, Qwen/Hermes <tool_call>, Mistral [TOOL_CALLS], Phi-4-mini "
                     "functools[...] and pythonic [f(x=1)] lists)")


def call_id(fmt: Format) -> str:
    if fmt.id_chars:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(fmt.id_chars))
    return "call_" + secrets.token_hex(12)


# ---- the prompt ----


class Plan(NamedTuple):
    """What a chat request's tools mean for its generation."""

    prompt: list[int]  # the conversation (and the tools) through the chat template
    response_format: dict | None  # the grammar of tool_choice "required" or a named function
    format: Format | None  # read the answer's tool calls in this format; None: plain text


def prepare(tokenizer: Tokenizer, vocab_size: int, messages: list[dict], tools: list[dict] | None,
            tool_choice: str | dict | None = None, parallel: bool = True) -> Plan:
    """The prompt, grammar and format of one chat request. `tools`: OpenAI's [{"type": "function",
    "function": {"name", "description", "parameters"}}]; `tool_choice`: "none", "auto" (the
    default with tools), "required" or {"type": "function", "function": {"name": ...}};
    `parallel`: whether "required" may call several tools (where the format allows)."""
    messages = conversation(messages)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InputError(f"tool_choice: {tool_choice!r:.60} needs tools")
        return Plan(tokenizer.encode_chat(messages), None, None)
    names = check_tools(tools)
    mode, name = _chosen(tool_choice, names)
    if mode == "none":  # the model is not told about the tools and answers in text
        return Plan(tokenizer.encode_chat(messages), None, None)
    fmt = detect(tokenizer)
    prompt = tokenizer.encode_chat(messages, tools=list(tools))
    if mode == "auto":
        return Plan(prompt, None, fmt)
    picked = [(i, t["function"]) for i, t in enumerate(tools) if mode == "required" or t["function"]["name"] == name]
    for i, f in picked:  # each schema alone first, so an error names its tool and the schema path
        structured.constraint(tokenizer, vocab_size, {"type": "json_schema", "json_schema": {
            "name": f["name"], "schema": parameters(f)}}, f"tools[{i}].function.parameters")
    functions, several = [f for _, f in picked], parallel and mode == "required"
    if fmt.python:
        from mlxfun.serve import pythonic  # it builds on this module's pieces

        lark = pythonic.grammar(functions, several, [f"tools[{i}].function.parameters" for i, _ in picked])
    else:
        lark = grammar(tokenizer, fmt, functions, several)
    return Plan(prompt, {"type": "grammar", "grammar": lark}, fmt)


class Arguments(dict):
    """A tool call's arguments as templates get them: a mapping (`tojson`, `.items()`, `is
    mapping`) whose text is JSON (a template that prints `{{ arguments }}` expects the JSON string
    OpenAI sends, not Python's repr)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def conversation(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them (as vLLM passes them): checked roles; each assistant
    tool call's `arguments` (OpenAI sends a JSON string) as the object it encodes; an assistant
    message with tool calls and no content has content "" (templates test and slice it); a tool
    result without a `name` gets the name of the call it answers (Hermes' template needs it)."""
    options.check_messages(messages, 0)
    out = []
    for j, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("content") is None and not (m["role"] == "assistant" and calls):
            # As OpenAI's API: templates write the content as text, and None is none.
            raise InputError(f"messages: message {j} ({m['role']}) has no content; only an assistant message "
                             "with tool_calls may leave it out")
        if not calls:  # templates test `'tool_calls' in message`: a null or empty list is no calls
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
            continue
        if not isinstance(calls, list):
            raise InputError(f"messages: message {j} tool_calls must be a list, got {type(calls).__name__}")
        fixed = []
        for k, call in enumerate(calls):
            f = call.get("function") if isinstance(call, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise InputError(f"messages: message {j} tool_calls[{k}] must be {{\"type\": \"function\", "
                                 f"\"function\": {{\"name\", \"arguments\"}}}}, got {call!r:.100}")
            args = f.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError as e:
                    raise InputError(f"messages: message {j} tool_calls[{k}].function.arguments is not JSON: "
                                     f"{e}") from None
            fixed.append({**call, "function": {**f, "arguments": Arguments(args) if isinstance(args, dict) else args}})
        out.append({**m, "content": "" if m.get("content") is None else m["content"], "tool_calls": fixed})
    return _name_results(out)


def _name_results(messages: list[dict]) -> list[dict]:
    """Tool results without a `name`, named after the call they answer (by tool_call_id)."""
    called = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())
              if isinstance(c.get("id"), str)}
    out = []
    for m in messages:
        answered = m.get("tool_call_id")
        if m["role"] == "tool" and "name" not in m and isinstance(answered, str) and answered in called:
            m = {**m, "name": called[answered]}
        out.append(m)
    return out


def check_tools(tools: list[dict]) -> list[str]:
    """The tools' names, each checked (OpenAI's characters, no name twice)."""
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise InputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}, got {t!r:.100}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise InputError(f"tools[{i}].function.name {name!r} is given twice")
        if not isinstance(f.get("parameters", {}), dict):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    return names


def _chosen(tool_choice, names: list[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None) or ("function", the name of the function to call)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InputError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {tool_choice!r}")
        return tool_choice, None
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(f, dict) or tool_choice.get("type") != "function" or not isinstance(f.get("name"), str):
        raise InputError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, got {tool_choice!r:.100}")
    if f["name"] not in names:
        raise InputError(f"tool_choice names function {f['name']!r}, which is not among the tools "
                         f"({', '.join(names)})")
    return "function", f["name"]


# ---- the grammar ----


def parameters(function: dict) -> dict:
    """A function's arguments schema (no parameters: an empty object)."""
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def grammar(tokenizer: Tokenizer, fmt: Format, functions: list[dict], parallel: bool) -> str:
    """Lark (llguidance's) for one call of any of `functions` (several with `parallel`, where the
    format allows), written as `fmt` writes it. Each call is `{"name": NAME, "<args_key>": ` then
    the arguments as their schema says (JSON as json.dumps writes it) then `}`."""
    calls = []
    for i, f in enumerate(functions):
        head = '{"name": ' + json.dumps(f["name"]) + f', "{fmt.args_key}": '
        schema = {**parameters(f), "x-guidance": structured.JSON_OPTIONS}
        calls.append(f"obj{i}: {_lark(tokenizer, head)} %json{json.dumps(schema)} \"}}\"")
    more = f"({_lark(tokenizer, fmt.sep)} call)*" if parallel and fmt.sep else ""
    lines = [_rule("start", _lark(tokenizer, fmt.head), "call", more, _lark(tokenizer, fmt.tail)),
             _rule("call", _lark(tokenizer, fmt.prefix), "obj", _lark(tokenizer, fmt.suffix)),
             "obj: " + " | ".join(f"obj{i}" for i in range(len(functions)))]
    return "\n".join(lines + calls)


def _rule(name: str, *parts: str) -> str:
    return f"{name}: " + " ".join(p for p in parts if p)


def _lark(tokenizer: Tokenizer, text: str) -> str:
    """`text` as Lark terminals: a marker that is one added token in this vocabulary by its id
    (llguidance matches added tokens only as tokens), the rest as quoted strings."""
    added = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
    parts = re.split("(" + "|".join(map(re.escape, MARKERS)) + ")", text)
    return " ".join(f"<[{added[p]}]>" if p in added else json.dumps(p) for p in parts if p)


# ---- reading calls ----


class Text(NamedTuple):
    """Content (text that is not a call)."""

    text: str


class CallStart(NamedTuple):
    """Call `index` begins: its id and function name."""

    index: int
    id: str
    name: str


class Args(NamedTuple):
    """A piece of call `index`'s arguments (JSON text)."""

    index: int
    text: str


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # JSON text


# A call whose name comes first: its arguments can stream as they come.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class Parser:
    """Generated text, fed as it comes -> Text, CallStart and Args pieces. Content passes until
    the format's opening (held back while it may be one); after it, every JSON object that is a
    call ({"name": ..., "arguments" or "parameters": ...}) is a call, and the text between calls
    (closing tags, commas, brackets) is dropped. If no call follows the opening, the whole of it
    is content after all (`close`)."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._pending = ""  # content held back: it may be the start of the opening
        self._plain = False  # the message is text (Llama: it does not start with a call)
        self._opening: str | None = None  # the opening text, once seen
        self._region = ""  # everything after the opening
        self._pos = 0  # where the next object is looked for in _region
        self._obj: _Scan | None = None  # the object being read
        self._args: _Scan | None = None  # its call's arguments, sent up to _sent
        self._sent = 0

    def feed(self, text: str) -> list:
        if self._opening is None:
            self._pending += text
            out = self._content()
        else:
            self._region += text
            out = []
        return out + self._scan() if self._opening is not None else out

    def close(self) -> list:
        """The end of the text: what was held back, as content (a call cut short stays as it is)."""
        if self._opening is None:
            text, self._pending = self._pending, ""
            return [Text(text)] if text else []
        if not self.calls:
            return [Text(self._opening + self._region)] if self._opening + self._region else []
        return []

    def _content(self) -> list:
        p = self._pending
        if not self._plain and self.fmt.opens is None:  # Llama: a call is the whole message
            s = p.lstrip()
            if not s or PYTHON_TAG.startswith(s):
                return []
            if s.startswith("{"):
                self._open(p[: len(p) - len(s)], s)
                return []
            if s.startswith(PYTHON_TAG):
                self._open(p[: len(p) - len(s) + len(PYTHON_TAG)], s[len(PYTHON_TAG):])
                return []
            self._plain = True
        if self._plain:
            self._pending = ""
            return [Text(p)] if p else []
        i = p.find(self.fmt.opens)
        if i >= 0:
            self._open(self.fmt.opens, p[i + len(self.fmt.opens):])
            return [Text(p[:i])] if i else []
        keep = next((k for k in range(min(len(p), len(self.fmt.opens) - 1), 0, -1) if p.endswith(self.fmt.opens[:k])),
                    0)
        self._pending = p[len(p) - keep:]
        return [Text(p[: len(p) - keep])] if len(p) > keep else []

    def _open(self, opening: str, rest: str) -> None:
        self._opening, self._region, self._pending = opening, rest, ""

    def _scan(self) -> list:
        out, r = [], self._region
        while True:
            if self._obj is None:
                i = r.find("{", self._pos)
                if i < 0:
                    self._pos = len(r)
                    return out
                self._obj, self._args = _Scan(i), None
            if self._args is None and (m := _HEAD.match(r, self._obj.start)):
                out.append(self._start(json.loads(m.group(1))))
                self._args, self._sent = _Scan(m.end()), m.end()
            if self._args is not None:
                end = self._args.end(r)
                stop = len(r) if end is None else end
                if stop > self._sent:
                    out.append(self._more(r[self._sent:stop]))
                    self._sent = stop
            end = self._obj.end(r)
            if end is None:
                return out
            if self._args is None and (call := _as_call(r[self._obj.start:end])) is not None:
                out += [self._start(call[0]), self._more(call[1])]  # not name first: whole, at its end
            self._obj, self._args, self._pos = None, None, end

    def _start(self, name: str) -> CallStart:
        self.calls.append(ToolCall(call_id(self.fmt), name, ""))
        return CallStart(len(self.calls) - 1, self.calls[-1].id, name)

    def _more(self, text: str) -> Args:
        self.calls[-1] = self.calls[-1]._replace(arguments=self.calls[-1].arguments + text)
        return Args(len(self.calls) - 1, text)


class _Scan:
    """Where the JSON object or array opening at `start` of a growing text closes, read as the
    text grows (each character once)."""

    def __init__(self, start: int):
        self.start, self._pos, self._depth, self._string, self._escaped, self._end = start, start, 0, False, False, None

    def end(self, text: str) -> int | None:
        """The index after the closing bracket, or None while it is still open."""
        while self._end is None and self._pos < len(text):
            c = text[self._pos]
            self._pos += 1
            if self._string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = self._pos
        return self._end


def _as_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole call object; None if `text` is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None and "arguments" not in obj and "parameters" not in obj:
        return None
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def reader(fmt: Format):
    """A parser of `fmt`'s calls: `feed(text)` and `close()` -> pieces, `.calls`."""
    if fmt.python:
        from mlxfun.serve import pythonic  # it builds on this module's pieces

        return pythonic.Parser(fmt)
    return Parser(fmt)


def parse(fmt: Format, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer -> (content, tool calls); content is None when there are calls and no other text."""
    parser = reader(fmt)
    content = "".join(p.text for p in parser.feed(text) + parser.close() if isinstance(p, Text))
    return (None if parser.calls and not content.strip() else content), parser.calls
