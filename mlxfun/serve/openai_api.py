"""OpenAI's API as data: request schemas (pydantic) in, response JSON (dicts) out.

The schemas check only shapes and types. Every range and limit (top_p in (0, 1], max_tokens > 0,
the context, the memory budget) is checked where `generate` checks it, in `mlxfun.engine.options` and the
engine, and `field_error` turns those messages into OpenAI's error shape, naming the request field.
The ranges are still stated in the OpenAPI schema (`_ranged`), so clients and fuzzers see them.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from mlxfun.engine.options import ROLES
from mlxfun.model.tokenizer import Tokenizer
from mlxfun.serve import tools

# ---- requests ----

# Choices per request at most (OpenAI's limit): each is a row, and all are built before any is queued.
MAX_N = 128


def _whole(v: Any) -> Any:
    """1.0 as 1: JSON Schema counts it an integer, and so do clients that write every number as a
    float. 1.5, 1e300 (past 2**53 a float is no exact integer), true and "1" stay as they are, for
    strict validation to refuse."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53 else v


Int = Annotated[int, BeforeValidator(_whole)]


def _ranged(kind: type, **bounds: Any) -> Any:
    """`kind` whose OpenAPI schema states the range that `options.requests` checks. Only the schema:
    pydantic checks the type, so an out-of-range value gets generate's message, naming the option."""
    return Annotated[Int if kind is int else kind, WithJsonSchema({"type": "integer" if kind is int else "number",
                                                                   **bounds})]


PositiveInt = _ranged(int, minimum=1)
NonNegativeInt = _ranged(int, minimum=0)
NonNegative = _ranged(float, minimum=0)
Positive = _ranged(float, exclusiveMinimum=0)
Fraction = _ranged(float, minimum=0, maximum=1)
TopP = _ranged(float, exclusiveMinimum=0, maximum=1)
Seed = _ranged(int, minimum=0, maximum=2**32 - 1)
Choices = _ranged(int, minimum=1, maximum=MAX_N)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Common(BaseModel):
    """Fields both endpoints take. None: the server's default (its generation flags)."""

    # Strict: no "0.5" for a float or true for an int. Unknown fields are ignored, as vLLM does;
    # the ones that would change the output are refused (`unsupported`).
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: NonNegative | None = None
    top_p: TopP | None = None
    top_k: NonNegativeInt | None = None  # 0: off
    min_p: Fraction | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: Positive | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Choices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension: generate max_tokens tokens past end-of-text
    response_format: dict | None = None  # checked by mlxfun.features.structured, which names what is wrong

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for a field whose meaning this server does not implement, when set."""
        extra = self.model_extra or {}
        for name, inert in _INERT.items():
            if name in extra and extra[name] not in inert:
                return name, f"{name} is not supported by this server"
        return None


# Fields the server does not implement -> the values that ask for nothing (accepted). Tools are
# chat's fields (ChatRequest); on /v1/completions they land here.
_INERT = {"logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
          "suffix": (None, ""), "best_of": (None, 1), "echo": (None, False)}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message; fields beyond role and content (name, tool_calls, ...) reach the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[TextPart] | None = None  # None: an assistant message's tool_calls say it all

    def as_dict(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


_PART = {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}
_CALL = {"type": "object", "required": ["type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
# A message's schema by role, as OpenAI's: content is required but for an assistant message, which
# may carry tool_calls instead. Only the schema: the roles and the content are checked by
# options.check_messages and tools.conversation, whose messages name the message.
ChatMessage = Annotated[Message, WithJsonSchema({"title": "Message", "anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": [r for r in ROLES if r != "assistant"]}, "content": _TEXT}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [*_TEXT["anyOf"], {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _CALL}}}]})]


class Function(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted; "required" and a named function are always enforced


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt | None = None  # at most the vocabulary
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}  # each below the vocabulary size
# One prompt (text or token ids) or several; only the schema states that lists are not empty, as
# options.requests checks (its message names the prompt).
Prompt = Annotated[str | list[str] | list[Int] | list[list[Int]], WithJsonSchema({"title": "Prompt", "anyOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}, _IDS,
    {"type": "array", "minItems": 1, "items": _IDS}]})]


class CompletionRequest(Common):
    prompt: Prompt
    logprobs: NonNegativeInt | None = None  # at most the vocabulary


# ---- errors ----


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None  # the request field at fault; None when the body as a whole is
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body, in OpenAI's shape (for the OpenAPI schema; `error` writes them)."""

    error: ErrorDetail


def _answers(description: str) -> dict:
    return {"model": ErrorResponse, "description": description}


# The responses of both completion endpoints beside a JSON 200, for the OpenAPI schema.
COMPLETION_RESPONSES: dict[int | str, dict] = {
    200: {"description": "The completion; with `stream: true`, server-sent events of chunks, then `data: [DONE]`",
          "content": {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1 has no itemSchema)
              "type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a chunk's JSON, or [DONE] at the end"}}}}}},
    400: _answers("An invalid request: `param` names the field at fault (null when the body is not a JSON object)"),
    413: _answers("max_tokens (or max_completion_tokens) needs more KV cache than this server has"),
    429: _answers("The queue is full, or the server is warming up; retry after the Retry-After header's seconds"),
    500: _answers("The engine failed while generating; a fresh engine takes the next requests"),
    # Declared, it also keeps FastAPI from declaring the 422 it would send: our validation errors are 400s.
    "4XX": _answers("Another client error (405: a method this path does not take), in the same shape"),
}


def error(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def schema_error(errors: list[dict]) -> dict:
    """pydantic's (or FastAPI's) validation errors as one OpenAI error naming the first field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [p for p in first["loc"] if p != "body"]
    param = ""
    for p in loc:
        if isinstance(p, int):
            param += f"[{p}]"
        elif "[" in p or p in ("str", "int", "float", "bool") or not p.isidentifier():
            break  # a union member's tag, not a field
        else:
            param += f".{p}" if param else p
    if not param:
        return error(f"the body must be a JSON object: {first['msg']}")
    return error(f"{param}: {first['msg'].lower()}", param)


# Option names in mlxfun's messages -> the OpenAI field, where they differ.
_FIELDS = {"logprobs": "top_logprobs"}


def field_error(message: str, chat: bool, request: Common) -> dict:
    """An InputError from `options.requests` as an OpenAI error naming the request's field."""
    prompt_field = "messages" if chat else "prompt"
    name = message.split(" ", 1)[0].removesuffix(":")  # "response_format: ..." names response_format
    if name == "prompt" or message.startswith(("no prompts", "this model has no chat template", "chat template")):
        # "prompt 0: message 1 has ..." -> "message 1 has ..."; "prompt 0 has ..." -> "the prompt has ..."
        message = re.sub(r"^prompt \d+(: | )", lambda m: "" if ":" in m.group(1) else "the prompt ", message)
        message = message.replace("pass chat=False", "use /v1/completions")
        return error(f"{prompt_field}: {message}", prompt_field)
    if name == "max_tokens" and isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        return error("max_completion_tokens" + message[len(name):], "max_completion_tokens")
    param = _FIELDS.get(name, name) if chat else name
    return error(param + message[len(name):], param)


# ---- responses ----


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


def token_bytes(tokenizer: Tokenizer, tid: int) -> list[int]:
    """The bytes a token stands for (a byte-level token may be part of a UTF-8 character)."""
    piece = tokenizer.token(tid) or ""
    if piece and all(c in _BYTES for c in piece) and tokenizer.decode([tid]) != piece:
        return [_BYTES[c] for c in piece]
    return list(tokenizer.decode([tid]).encode("utf-8"))


def _entry(tokenizer: Tokenizer, tid: int, logprob: float) -> dict:
    return {"token": tokenizer.decode([tid]), "logprob": logprob, "bytes": token_bytes(tokenizer, tid)}


def chat_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float], top: list | None) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    return {"content": [
        {**_entry(tokenizer, t, lp), "top_logprobs": [_entry(tokenizer, i, v) for i, v in (top[k] if top else ())]}
        for k, (t, lp) in enumerate(zip(ids, logprobs))]}


def completion_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs: list[float], top: list | None,
                        offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in row} for row in top] if top else None,
            "text_offset": offsets}


def chat_message_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                        calls: list[tools.ToolCall] = ()) -> dict:
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(pieces: list) -> dict:
    """A chunk's delta from a tools.Parser's pieces: content, then tool_calls entries (a call's
    first names it: index, id, type, name; the next ones carry more of its arguments)."""
    content = "".join(p.text for p in pieces if isinstance(p, tools.Text))
    calls: list[dict] = []
    for p in pieces:
        if isinstance(p, tools.CallStart):
            calls.append({"index": p.index, "id": p.id, "type": "function", "function": {"name": p.name,
                                                                                        "arguments": ""}})
        elif isinstance(p, tools.Args) and calls and calls[-1]["index"] == p.index:
            calls[-1]["function"]["arguments"] += p.text
        elif isinstance(p, tools.Args):
            calls.append({"index": p.index, "function": {"arguments": p.text}})
    return {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(rid: str, created: int, model: str, kind: str, choices: list[dict]) -> dict:
    """kind: "chat.completion", "chat.completion.chunk" or "text_completion"."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
