"""Tool calling without a server: each family's format read (whole and streamed), the grammar of
tool_choice "required" / a named function writes exactly that format on a tiny model, and the
conversation (tools, assistant tool calls, tool results) renders through the chat template."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from helpers import full_byte_tokenizer, tiny_config, tiny_params

from mlxfun.errors import InputError
from mlxfun.features import structured
from mlxfun.generate import generate
from mlxfun.model.load import Model
from mlxfun.serve import tools

# Minimal templates in each family's way (the real ones are longer; what we detect and read is this).
QWEN_TEMPLATE = (
    '{%- if tools %}{{- "<|im_start|>system\\nTools:" }}{%- for t in tools %}{{- "\\n" + t | tojson }}{%- endfor %}'
    '{{- "\\nCall one as <tool_call>\\n{\\"name\\": ..., \\"arguments\\": {...}}\\n</tool_call><|im_end|>\\n" }}'
    '{%- endif %}'
    '{%- for m in messages %}'
    '{%- if m.role == "assistant" and m.tool_calls %}{{- "<|im_start|>assistant" }}'
    '{%- for c in m.tool_calls %}'
    '{{- "\\n<tool_call>\\n{\\"name\\": \\"" + c.function.name + "\\", \\"arguments\\": " }}'
    '{{- c.function.arguments | tojson }}{{- "}\\n</tool_call>" }}{%- endfor %}{{- "<|im_end|>\\n" }}'
    '{%- elif m.role == "tool" %}{{- "<|im_start|>user\\n<tool_response>\\n" + m.content + "\\n</tool_response>'
    '<|im_end|>\\n" }}'
    '{%- else %}{{- "<|im_start|>" + m.role + "\\n" + m.content + "<|im_end|>\\n" }}{%- endif %}'
    '{%- endfor %}{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}')
LLAMA_TEMPLATE = (
    '{%- for m in messages %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\\n\\n" }}'
    '{%- if tools and loop.last %}{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": '
    'dictionary of argument name and its value}.\\n" }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}'
    '{%- endif %}{{- m.content }}{{- "<|eot_id|>" }}{%- endfor %}'
    '{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- endif %}')
MISTRAL_TEMPLATE = (
    '{%- if tools %}{{- "[AVAILABLE_TOOLS] " + tools | tojson + "[/AVAILABLE_TOOLS]" }}{%- endif %}'
    '{%- for m in messages %}{%- if m.tool_calls %}{{- "[TOOL_CALLS] " + m.tool_calls | tojson }}'
    '{%- else %}{{- "[INST] " + m.content + "[/INST]" }}{%- endif %}{%- endfor %}')
TEMPLATES = {"qwen": QWEN_TEMPLATE, "llama3_json": LLAMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def model_with(template: str, added: tuple[str, ...] = ()) -> Model:
    tokenizer = full_byte_tokenizer(added, template)
    config = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048)
    params, _ = tiny_params(config, seed=3)
    return Model(config, params, tokenizer, "tiny tools")


# ---- reading each family's calls ----

QWEN_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
MISTRAL_TEXT = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice", "days": 1}}, {"name": "now", ' \
               '"arguments": {}}]'
LLAMA_TEXT = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}'
CASES = [
    (tools.QWEN, QWEN_TEXT, "Let me look.\n", [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]),
    (tools.MISTRAL, MISTRAL_TEXT, None, [("get_weather", {"city": "Nice", "days": 1}), ("now", {})]),
    (tools.LLAMA3, LLAMA_TEXT, None, [("get_weather", {"city": "Rome", "days": 3})]),
    (tools.LLAMA3, '  <|python_tag|>{"name": "now", "parameters": {}}', None, [("now", {})]),
    # Arguments first, or as a JSON string: read when the object closes.
    (tools.QWEN, '<tool_call>\n{"arguments": {"a": [1, "}"]}, "name": "f"}\n</tool_call>', None,
     [("f", {"a": [1, "}"]})]),
    (tools.QWEN, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    # Text that is no call stays content.
    (tools.QWEN, "Paris is sunny. <tool_ is not a tag, {\"name\": 1}", "Paris is sunny. <tool_ is not a tag, "
     "{\"name\": 1}", []),
    (tools.QWEN, "<tool_call> no object here", "<tool_call> no object here", []),
    (tools.LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
    (tools.LLAMA3, 'Say {"name": "f", "parameters": {}}', 'Say {"name": "f", "parameters": {}}', []),
    (tools.MISTRAL, "Hello [TOOL_CALL", "Hello [TOOL_CALL", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_each_family_format_reads_as_tool_calls(fmt, text, content, calls):
    got_content, got = tools.parse(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got) or fmt is tools.MISTRAL
    assert all(len(c.id) == 9 and c.id.isalnum() for c in got) or fmt is not tools.MISTRAL
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_pieces_reassemble_into_the_whole_answer(fmt, text, content, calls, size):
    parser = tools.Parser(fmt)
    pieces = []
    for i in range(0, len(text), size):
        pieces += parser.feed(text[i:i + size])
    pieces += parser.close()
    streamed_content = "".join(p.text for p in pieces if isinstance(p, tools.Text))
    assert streamed_content == (content or "")
    starts = [p for p in pieces if isinstance(p, tools.CallStart)]
    assert [(s.index, s.name) for s in starts] == [(i, name) for i, (name, _) in enumerate(calls)]
    for s in starts:  # the name comes first, then the arguments in pieces that add up
        args = [(k, p.text) for k, p in enumerate(pieces) if isinstance(p, tools.Args) and p.index == s.index]
        assert all(k > pieces.index(s) for k, _ in args)
        assert json.loads("".join(t for _, t in args)) == calls[s.index][1]
    whole = tools.parse(fmt, text)[1]
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in whole]


def test_arguments_stream_while_the_model_writes_them():
    parser = tools.Parser(tools.QWEN)
    pieces = [p for ch in QWEN_TEXT for p in parser.feed(ch)]
    args = [p.text for p in pieces if isinstance(p, tools.Args) and p.index == 0]
    assert "".join(args) == '{"city": "Paris", "days": 2}' and len(args) == len('{"city": "Paris", "days": 2}')


def test_a_call_cut_short_keeps_what_was_written():
    content, calls = tools.parse(tools.QWEN, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]


# ---- the grammar writes exactly the format the parser reads ----


def written(fmt: tools.Format, calls: list[tools.ToolCall]) -> str:
    """The calls as `fmt` writes them, arguments as the model wrote them."""
    objects = [fmt.prefix + f'{{"name": {json.dumps(c.name)}, "{fmt.args_key}": {c.arguments}}}' + fmt.suffix
               for c in calls]
    return fmt.head + (fmt.sep or "").join(objects) + fmt.tail


@pytest.mark.parametrize("added", [(), ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")], ids=["bytes", "tokens"])
@pytest.mark.parametrize("family", list(TEMPLATES))
def test_required_and_named_grammars_write_the_family_format(family, added):
    model = model_with(TEMPLATES[family], added)
    fmt = tools.detect(model.tokenizer)
    assert fmt.name == family
    vocab = model.config.vocab_size
    required = tools.prepare(model.tokenizer, vocab, ASK, TOOLS, "required", parallel=False)
    named = tools.prepare(model.tokenizer, vocab, ASK, TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    if added:  # markers that are one token are written as that token
        assert all(f"<[{model.tokenizer.backend.token_to_id(m)}]>" in required.response_format["grammar"]
                   for m in added if m in fmt.head + fmt.prefix + fmt.suffix)
    seeds = list(range(6))
    prompts = [required.prompt] * 6 + [named.prompt] * 6
    out = generate(model, prompts, max_tokens=200, temperature=1.0, seed=seeds + seeds,
                   response_format=[required.response_format] * 6 + [named.response_format] * 6)
    for i, text in enumerate(out.texts):
        assert out.finish_reasons[i] == "stop", text
        content, calls = tools.parse(fmt, text)
        assert content is None and len(calls) == 1
        assert text == written(fmt, calls)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
        assert i < 6 or calls[0].name == "get_weather"
    now = written(fmt, [tools.ToolCall("a", "now", "{}")])
    weather = written(fmt, [tools.ToolCall("a", "get_weather", '{"city": "Oslo", "days": 4}')])
    assert advance_all(model, required.response_format, now) and advance_all(model, required.response_format, weather)
    assert advance_all(model, named.response_format, weather) and not advance_all(model, named.response_format, now)


def advance_all(model: Model, response_format: dict, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized as the model would write it) and may end after it."""
    matcher = structured.constraint(model.tokenizer, model.config.vocab_size, response_format).matcher(frozenset({0}))
    mask = np.zeros(structured.words(model.config.vocab_size), np.uint32)
    for t in model.tokenizer.encode(text):
        matcher.fill_mask(mask)
        if not mask[t // 32] >> (t % 32) & 1:
            return False
        matcher.advance(t)
    return matcher.can_end


@pytest.mark.parametrize("family", ["qwen", "mistral"])
def test_parallel_calls_where_the_format_has_them(family):
    model = model_with(TEMPLATES[family], ("<tool_call>", "</tool_call>", "[TOOL_CALLS]"))
    fmt = tools.detect(model.tokenizer)
    two = [tools.ToolCall("a", "now", "{}"), tools.ToolCall("b", "get_weather", '{"city": "Oslo", "days": 4}')]
    text = written(fmt, two)
    parallel = tools.prepare(model.tokenizer, model.config.vocab_size, ASK, TOOLS, "required").response_format
    single = tools.prepare(model.tokenizer, model.config.vocab_size, ASK, TOOLS, "required",
                           parallel=False).response_format
    assert advance_all(model, parallel, text) and not advance_all(model, single, text)
    assert advance_all(model, single, written(fmt, two[1:]))
    assert not advance_all(model, parallel, text.replace('"Oslo"', '"Oslo", "x": 1'))  # the schema holds
    assert [(c.name, c.arguments) for c in tools.parse(fmt, text)[1]] == [(c.name, c.arguments) for c in two]


# ---- the conversation ----


def test_tool_calls_and_results_render_through_the_template():
    tk = full_byte_tokenizer((), QWEN_TEMPLATE)
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plan = tools.prepare(tk, tk.vocab_size, messages, TOOLS)
    tool_lines = "".join("\n" + json.dumps(t) for t in TOOLS)
    want = ("<|im_start|>system\nTools:" + tool_lines + '\nCall one as <tool_call>\n{"name": ..., "arguments": {...}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    assert tk.decode(plan.prompt) == want and plan.format is tools.QWEN and plan.response_format is None
    none = tools.prepare(tk, tk.vocab_size, ASK, TOOLS, "none")  # "none": no tools in the prompt, no reading
    assert tk.decode(none.prompt) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert none.format is None and none.response_format is None


@pytest.mark.parametrize("template, messages, tools_, choice, words", [
    (QWEN_TEMPLATE, ASK, None, "required", "tool_choice: 'required' needs tools"),
    (QWEN_TEMPLATE, ASK, TOOLS, {"type": "function", "function": {"name": "nope"}},
     "tool_choice names function 'nope', which is not among the tools (get_weather, now)"),
    (QWEN_TEMPLATE, ASK, TOOLS, "sometimes", "tool_choice must be one of none, auto, required"),
    (QWEN_TEMPLATE, ASK, [TOOLS[0], TOOLS[0]], "auto", "tools[1].function.name 'get_weather' is given twice"),
    (QWEN_TEMPLATE, ASK, [{"type": "function", "function": {"name": "a b"}}], "auto",
     "tools[0].function.name must be 1 to 64 letters"),
    (QWEN_TEMPLATE, ASK, [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "array", "items": {"type": "strng"}}}}}}], "required",
     "tools[1].function.parameters: json_schema 'f' at #/properties/n/items"),
    (QWEN_TEMPLATE, [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "now", "arguments": "{oops"}}]}], TOOLS, "auto", "messages: message 0 tool_calls[0].function.arguments "
     "is not JSON"),
    ("{{ messages[0].content }}", ASK, TOOLS, "auto", "tools: this model's chat template does not render tools"),
    ("{% for t in tools %}{{ t }}{% endfor %}", ASK, TOOLS, "auto", "a format we do not read"),
])
def test_bad_tools_are_input_errors_naming_the_field(template, messages, tools_, choice, words):
    tk = full_byte_tokenizer((), template)
    with pytest.raises(InputError) as e:
        tools.prepare(tk, tk.vocab_size, messages, tools_, choice)
    assert words in str(e.value)
