"""Structured output and tool calls through `mlxfun serve` and the real `openai` client: a
json_schema response on the default model, and on a tiny model with a tool-aware chat template
written here, tool_choice "required" and a named function (arguments that validate, streamed
deltas that reassemble into the same call) and a follow-up turn with the tool's result. Servers
run on a free port of 127.0.0.1; every request is bounded in tokens and every wait in time."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import openai
import pytest
from helpers import full_byte_tokenizer, tiny_config, tiny_params
from test_server import Server
from test_tools import QWEN_TEMPLATE, SCHEMAS, TOOLS, WEATHER

import mlxfun
from mlxfun.model.load import Model
from mlxfun.serve import tools

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "country": {"enum": ["France", "Germany", "Italy"]}},
        "required": ["city", "country"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    server = Server("--rows", "4", "--max-tokens", "32", log_path=tmp_path_factory.mktemp("real-structured") / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(server, model): a random model whose byte-level tokenizer has a Qwen-style tool template."""
    tokenizer = full_byte_tokenizer((), QWEN_TEMPLATE)
    config = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048)
    params, _ = tiny_params(config, seed=4)
    folder = tmp_path_factory.mktemp("tiny-tools")
    mlxfun.save(Model(config, params, tokenizer, "tiny tools"), folder)
    server = Server("--model", str(folder), "--rows", "4", "--max-tokens", "200", "--temp", "0",
                    log_path=folder / "log")
    model = mlxfun.load(str(folder))
    mx.eval(model.params)
    yield server, model
    server.stop()


def offline(model: Model, messages: list[dict], tool_choice, **options):
    """The answer `generate` gives for the same conversation, tools and grammar."""
    plan = tools.prepare(model.tokenizer, model.config.vocab_size, messages, TOOLS, tool_choice, parallel=False)
    out = mlxfun.generate(model, [plan.prompt], response_format=plan.response_format, max_tokens=200, **options)
    return tools.parse(plan.format, out.texts[0]), out.finish_reasons[0]


# ---- response_format on the default model ----


def test_json_schema_response_through_the_openai_client(real, model_q4):
    messages = [{"role": "user", "content": "Name a city in Europe and its country, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = real.client().chat.completions.create(model="x", messages=messages, response_format=fmt, max_tokens=30)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.tool_calls is None
    want = mlxfun.generate(model_q4, [messages], response_format=fmt, max_tokens=30)
    assert text == want.texts[0]

    choice = {"type": "choice", "choice": ["Paris", "Berlin", "Rome"]}
    prompt = "The capital of Italy is"
    completion = real.client().completions.create(model="x", prompt=prompt, max_tokens=5,
                                                  extra_body={"response_format": choice})
    assert completion.choices[0].text == mlxfun.generate(model_q4, prompt, max_tokens=5,
                                                         response_format=choice).texts[0]
    assert completion.choices[0].text in choice["choice"] and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("change, field, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "items": {"type": "strng"}}}}}}},
     "response_format", "json_schema 's' at #/properties/a/items"),
    ({"response_format": {"type": "json"}}, "response_format", "unknown type 'json'"),
    ({"tools": TOOLS}, "tools", "this model's chat template does not render tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "required"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_formats_and_tools_get_400_naming_the_field(real, change, field, words):
    body = {"model": "x", "messages": ASK, "max_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError) as e:
        real.client().chat.completions.create(**body)
    assert e.value.body["param"] == field and words in e.value.body["message"], e.value.body


# ---- tools on a tiny model with a tool-aware template ----


def test_required_and_named_tool_calls_validate_and_equal_offline(tiny):
    server, model = tiny
    client = server.client()
    for choice in ("required", WEATHER_CALL):
        reply = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert choice == "required" or call.function.name == "get_weather"
        (content, (want,)), reason = offline(model, ASK, choice)
        assert (call.function.name, call.function.arguments, reason) == (want.name, want.arguments, "stop")


def test_streamed_tool_call_deltas_reassemble_into_the_same_call(tiny):
    server, _ = tiny
    client = server.client()
    body = dict(model="x", messages=ASK, tools=TOOLS, tool_choice=WEATHER_CALL)
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and len(rest) > 1  # the name first, then the arguments in pieces
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    assert (first.function.name, arguments) == (whole.function.name, whole.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_tool_result_in_a_follow_up_turn_renders_and_runs(tiny):
    server, model = tiny
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 1}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    reply = server.client().chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=12)
    rendered = ("<|im_start|>system\nTools:" + "".join("\n" + json.dumps(t) for t in TOOLS)
                + '\nCall one as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n'
                "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call><|im_end|>\n'
                "<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert reply.usage.prompt_tokens == len(rendered.encode())  # one token per byte
    want = mlxfun.generate(model, rendered, max_tokens=12)
    assert reply.choices[0].message.content == want.texts[0]
    assert reply.choices[0].finish_reason == want.finish_reasons[0] and not reply.choices[0].message.tool_calls
