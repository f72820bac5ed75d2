"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them: the same Jinja
environment (sandboxed, `trim_blocks` and `lstrip_blocks`, `{% break %}` / `{% continue %}`, the
`{% generation %}` block), the same helpers (`tojson` with its keyword arguments,
`raise_exception`, `strftime_now`) and variables (`messages`, `tools`, `add_generation_prompt`,
`bos_token`, `eos_token`).

Two differences, both where Hugging Face fails: a template that refuses the conversation while it
starts with a system message (Gemma 2's "System role not supported") gets it again with the
system message folded into the first user message, as Gemma 3's own template does; and any error
of a template, its syntax included, is an InputError naming the template's line, never a stack
trace.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

from mlxfun.errors import InputError

_FOLD_SEP = "\n\n"  # between a folded system message and the first user message (Gemma 3's)


def render(source: str, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text of `messages` and `tools` (OpenAI's [{"type": "function", "function": ...}])
    through the template `source`."""
    template = _compile(source)
    variables = {"tools": tools, "add_generation_prompt": add_generation_prompt, "bos_token": bos_token,
                 "eos_token": eos_token}
    try:
        return _render(template, messages, variables)
    except _Refused as refused:
        if not (messages and messages[0].get("role") == "system"):
            raise InputError(f"chat template: {refused}") from None
        try:
            return _render(template, fold_system(messages), variables)
        except _Refused as again:  # folding did not help
            why = "" if str(again) == str(refused) else f" (with the system message folded into the first user " \
                f"message, as the template refused it: {refused})"
            raise InputError(f"chat template: {again}{why}") from None


def fold_system(messages: list[dict]) -> list[dict]:
    """The conversation with its first (system) message folded into the user message after it:
    "<system>\\n\\n<user>", as Gemma 3's template does; a user message of its own when no user
    message follows."""
    system, rest = messages[0], messages[1:]
    text = _text(system.get("content"))
    if rest and rest[0].get("role") == "user":
        content = rest[0].get("content")
        if isinstance(content, list):  # content parts: the system text goes first
            merged = [{"type": "text", "text": text + _FOLD_SEP}, *content]
        else:
            merged = text + _FOLD_SEP + (content or "")
        return [{**rest[0], "content": merged}, *rest[1:]]
    return [{"role": "user", "content": text}, *rest]


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


class _Refused(Exception):
    """The template called raise_exception: it refuses this conversation."""


def _render(template, messages: list[dict], variables: dict) -> str:
    from jinja2 import TemplateError

    try:
        return template.render(messages=messages, **variables)
    except _Refused:
        raise
    except TemplateError as e:
        raise InputError(f"chat template{_where(e)}: {e}") from None
    except Exception as e:  # a template is data: whatever it does wrong is the request's error
        raise InputError(f"chat template{_where(e)}: {type(e).__name__}: {e}") from None


def _where(error: Exception) -> str:
    """" line N" of the template where `error` was raised, as Jinja maps its frames, or ""."""
    line, tb = None, error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" line {line}" if line is not None else ""


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise InputError(f"chat template line {e.lineno}: {e.message}") from None


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's text for training
        masks in Hugging Face): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise _Refused(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env
