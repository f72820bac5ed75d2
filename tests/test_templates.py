"""The real chat templates of the families people run (tests/templates/, each naming its source
in its first line): a conversation with a system message, tools, an assistant tool call and its
result renders as the template writes it; `detect` finds the family's tool-call format; the
family's own output reads back as its calls, whole and streamed alike; tool_choice "required"
constrains to exactly that format. Gemma's templates have no system role: the system message is
folded into the first user turn. A template's errors are InputErrors that name them."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import jsonschema
import numpy as np
import pytest
import test_tools
from helpers import full_byte_tokenizer
from test_tools import model_with, written

from mlxfun import chat_template
from mlxfun.errors import InputError
from mlxfun.features import structured
from mlxfun.generate import generate
from mlxfun.serve import tools

MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")  # one token each in the families' vocabularies


def template(name: str) -> str:
    """tests/templates/NAME.jinja without its first line (where it comes from)."""
    header, body = (Path(__file__).parent / "templates" / f"{name}.jinja").read_text().split("\n", 1)
    assert header.startswith("{#- Source: ") and header.endswith("-#}")
    return body


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city."},
                                            "days": {"type": "integer", "description": "How many days."}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}]
# As an OpenAI client sends it: no content with the call, its arguments as a string, the result
# without the function's name. The id has Mistral's 9 letters and digits, which its templates check.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
]
TODAY = datetime.now().strftime("%d %b %Y")  # Llama's templates print the date (strftime_now)
LLAMA_TOOLS = "".join(json.dumps(t, indent=4) + "\n\n" for t in TOOLS)
ARGS = '{"city": "Paris", "days": 2}'
CALL = '{"name": "get_weather", "arguments": ' + ARGS + "}"
NOW = '{"name": "now", "arguments": {}}'
LLAMA_TAIL = ('<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>'
              '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
              + ARGS + '}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{"output": "sunny"}<|eot_id|>'
              '<|start_header_id|>assistant<|end_header_id|>\n\n')
PARIS = ("get_weather", {"city": "Paris", "days": 2})


class Family(NamedTuple):
    format: tools.Format
    rendered: list[str]  # parts of the rendered conversation, in order; the last one ends it
    output: str  # an answer in the family's format
    content: str | None  # ... its content
    calls: list[tuple[str, dict]]  # ... and its calls


FAMILIES = {
    "qwen3": Family(tools.QWEN, [
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n",
        "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>",
        '<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n'
        '</tool_response><|im_end|>\n<|im_start|>assistant\n'],
        'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "I will look.\n", [PARIS, ("now", {})]),
    # Hermes' tools block opens no system turn; its history writes the arguments first, and a
    # model may copy that: such a call is read when its object closes.
    "vllm_hermes": Family(tools.QWEN, [
        'Here are the available tools: <tools> {"type": "function", "function": {"name": "get_weather", "description": '
        '"get_weather(city: str, days: int) - The forecast.\n\n    Args:\n        city(str): The city.        '
        'days(int): How many days.", "parameters": ' + json.dumps(WEATHER) + "}\n",
        '</tool_call><|im_end|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{ "arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}\n'
        '</tool_call> <|im_end|>\n<|im_start|>tool\n<tool_response>\n{"name": "get_weather", "content": "sunny"}\n'
        '</tool_response> <|im_end|>\n<|im_start|>assistant\n'],
        '<tool_call>\n{ "arguments": ' + ARGS + ', "name": "get_weather"}\n</tool_call>', None, [PARIS]),
    # Mistral puts the system message in the last user turn: a conversation that ends with a tool
    # result has none, and the template drops it (test_mistral_puts_the_system_message_in_the_last_user_turn).
    "mistral_nemo": Family(tools.MISTRAL_NEMO, [
        "[AVAILABLE_TOOLS]" + json.dumps(TOOLS) + "[/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST][TOOL_CALLS]["
        + CALL[:-1] + ', "id": "abcDEF123"}][TOOL_RESULTS]{"content": sunny, "call_id": "abcDEF123"}[/TOOL_RESULTS]'],
        f"[TOOL_CALLS][{CALL}, {NOW}]", None, [PARIS, ("now", {})]),
    "vllm_mistral_parallel": Family(tools.MISTRAL, [
        "[AVAILABLE_TOOLS] " + json.dumps(TOOLS) + "[/AVAILABLE_TOOLS][INST] Weather in Paris?[/INST][TOOL_CALLS] ["
        + CALL[:-1] + ', "id": "abcDEF123"}][TOOL_RESULTS] {"content": sunny, "call_id": "abcDEF123"}[/TOOL_RESULTS]'],
        "[TOOL_CALLS] [" + CALL[:-1] + ', "id": "abcDEF123"}]', None, [PARIS]),
    # This one prints the tools with Python's repr and writes no calls: it expects them as the
    # assistant's content (the rendering is Hugging Face's; the template is as it is).
    "vllm_mistral": Family(tools.MISTRAL, [
        "[AVAILABLE_TOOLS]" + str(TOOLS) + "[/AVAILABLE_TOOLS][INST]Weather in Paris?[/INST][TOOL_CALLS][TOOL_RESULTS]"
        "sunny[/TOOL_RESULTS]"],
        '[TOOL_CALLS] [{"name": "now", "arguments": {}}]', None, [("now", {})]),
    "vllm_llama3.1_json": Family(tools.LLAMA3, [
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\n"
        f"Today Date: {TODAY}\n\nBe brief.<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\n",
        LLAMA_TOOLS + "Weather in Paris?<|eot_id|>" + LLAMA_TAIL.split("Weather in Paris?<|eot_id|>")[1]],
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [PARIS]),
    "vllm_llama3.2_json": Family(tools.LLAMA3, [
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: December 2023\n"
        f"Today Date: {TODAY}\n\nYou have access to the following functions.",
        LLAMA_TOOLS + "Be brief.<|eot_id|>" + LLAMA_TAIL],
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [PARIS]),
    # The template prints each value with "%s": strings without their quotes.
    "vllm_llama3.2_pythonic": Family(tools.PYTHONIC, [
        f"Today Date: {TODAY}\n\nYou have access to the following functions. To call functions, please respond with a "
        "python list of the calls.",
        LLAMA_TOOLS + "Be brief.<|eot_id|>" + LLAMA_TAIL.replace('{"name": "get_weather", "parameters": ' + ARGS + "}",
                                                                 "[get_weather(city=Paris, days=2)]")],
        '[get_weather(city="Paris", days=2), now()]', None, [PARIS, ("now", {})]),
    # Its `{% set first = false %}` inside the loop does not outlive an iteration (Jinja's scoping),
    # so the arguments come out without their comma: Hugging Face's rendering, the template's bug.
    "vllm_gemma3_pythonic": Family(tools.PYTHONIC, [
        "<start_of_turn>user\nBe brief.\n\nTools (functions) are available.",
        json.dumps(TOOLS, indent=4) + "\n\nWeather in Paris?<end_of_turn>\n",
        '<start_of_turn>model\n[get_weather(city="Paris"days=2)]<end_of_turn>\n<start_of_turn>user\n<tool_response>\n'
        "sunny</tool_response><end_of_turn>\n<start_of_turn>model\n"],
        "[get_weather(city='Paris', days=2)]", None, [PARIS]),
    # It prints the arguments with {{ }}: JSON, as OpenAI sends them (not Python's repr of a dict).
    "vllm_phi4_mini": Family(tools.PHI4, [
        "<|system|>\nBe brief.In addition to plain text responses",
        "".join(json.dumps(t, indent=4) + "\n\n" for t in TOOLS) + "<|end|>",
        "<|user|>Weather in Paris?<|end|><|assistant|>" + CALL + "<|end|><|tool|>sunny<|end|><|assistant|>"],
        f"functools[{CALL}, {NOW}]", None, [PARIS, ("now", {})]),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_conversation_renders_as_the_template_writes_it(name):
    family = FAMILIES[name]
    tk = full_byte_tokenizer((), template(name))
    plan = tools.prepare(tk, tk.vocab_size, CONVERSATION, TOOLS)
    text = tk.decode(plan.prompt)
    assert text == tk.apply_chat_template(tools.conversation(CONVERSATION), tools=TOOLS)
    at = 0
    for part in family.rendered:
        assert part in text[at:], (part, text)
        at = text.index(part, at) + len(part)
    assert text.endswith(family.rendered[-1])
    assert plan.format is family.format and plan.response_format is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_detect_finds_the_family_format(name):
    assert tools.detect(full_byte_tokenizer((), template(name))) is FAMILIES[name].format


def test_formats_we_do_not_read_are_named():
    for source, words in [(template("gemma2"), "does not render tools"), (template("gemma3"), "does not render tools"),
                          ("{{ tools }}<tool_call>\n<function=f>\n</tool_call>", "as XML (<function=...>)")]:
        with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
            tools.detect(full_byte_tokenizer((), source))


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_family_output_reads_as_its_calls_whole_and_streamed(name, size):
    family = FAMILIES[name]
    content, calls = tools.parse(family.format, family.output)
    assert content == family.content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == family.calls
    assert len({c.id for c in calls}) == len(calls)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) if family.format.id_chars == 9 else \
        all(c.id.startswith("call_") for c in calls)
    parser = tools.reader(family.format)
    pieces = [p for i in range(0, len(family.output), size) for p in parser.feed(family.output[i:i + size])]
    pieces += parser.close()
    assert "".join(p.text for p in pieces if isinstance(p, tools.Text)) == (content or "")
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in calls]
    starts = [p for p in pieces if isinstance(p, tools.CallStart)]
    assert [s.name for s in starts] == [name for name, _ in family.calls]
    for s in starts:  # each call's arguments come after its name and add up to them
        args = [(k, p.text) for k, p in enumerate(pieces) if isinstance(p, tools.Args) and p.index == s.index]
        assert all(k > pieces.index(s) for k, _ in args)
        assert "".join(t for _, t in args) == calls[s.index].arguments


def accepts(tokenizer, response_format: dict, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer splits it) and may end after it."""
    vocab = tokenizer.vocab_size
    matcher = structured.constraint(tokenizer, vocab, response_format).matcher(frozenset({0}))
    mask = np.zeros(structured.words(vocab), np.uint32)
    for t in tokenizer.encode(text):
        matcher.fill_mask(mask)
        if not mask[t // 32] >> (t % 32) & 1:
            return False
        matcher.advance(t)
    return matcher.can_end


def canonical(fmt: tools.Format, calls: list[tuple[str, dict]]) -> str:
    """The calls as the format writes them (the grammar's spacing)."""
    if fmt.python:
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"
    return written(fmt, [tools.ToolCall("x", n, json.dumps(a)) for n, a in calls])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_required_grammar_takes_the_family_format(name):
    family = FAMILIES[name]
    tk = full_byte_tokenizer(MARKERS, template(name))
    required = tools.prepare(tk, tk.vocab_size, CONVERSATION[:2], TOOLS, "required").response_format
    one = canonical(family.format, [PARIS])
    assert accepts(tk, required, one)
    assert tools.parse(family.format, one)[1][0].arguments == json.dumps(PARIS[1])
    both = canonical(family.format, [PARIS, ("now", {})])
    assert accepts(tk, required, both) == (family.format.sep is not None)
    assert not accepts(tk, required, canonical(family.format, [("get_weather", {"city": "Paris"})]))  # no "days"
    others = {f.format for f in FAMILIES.values()} - {family.format}
    assert not any(accepts(tk, required, canonical(other, [PARIS])) for other in others)


@pytest.mark.parametrize("name", ["vllm_gemma3_pythonic", "vllm_phi4_mini"])
def test_required_and_named_grammars_write_what_the_parser_reads(name):
    """A random model under the grammar: every answer is calls the parser reads, whose arguments
    hold to their schema (the formats new here; test_tools covers the others). The tools of
    test_tools, whose strings are short, so that every answer ends."""
    model = model_with(template(name))
    fmt, bounded = FAMILIES[name].format, test_tools.TOOLS
    required = tools.prepare(model.tokenizer, model.config.vocab_size, CONVERSATION[:2], bounded, "required")
    named = tools.prepare(model.tokenizer, model.config.vocab_size, CONVERSATION[:2], bounded,
                          {"type": "function", "function": {"name": "get_weather"}})
    out = generate(model, [required.prompt] * 3 + [named.prompt] * 3, max_tokens=120, temperature=1.0,
                   seed=[0, 1, 2] * 2, response_format=[required.response_format] * 3 + [named.response_format] * 3)
    for i, text in enumerate(out.texts):
        assert out.finish_reasons[i] == "stop", text
        content, calls = tools.parse(fmt, text)
        assert content is None and calls and (i < 3 or len(calls) == 1), text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), test_tools.SCHEMAS[c.name])
            assert i < 3 or c.name == "get_weather"


def test_pythonic_grammar_takes_optional_arguments_in_the_schema_order():
    schema = {"type": "object", "$defs": {"n": {"type": "integer"}}, "required": ["b"],
              "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}}
    tk = full_byte_tokenizer((), template("vllm_llama3.2_pythonic"))
    fn = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    rf = tools.prepare(tk, tk.vocab_size, CONVERSATION[1:2], fn, "required", parallel=False).response_format
    for text in ["[f(b=1)]", "[f(a=1, b=2)]", "[f(b=1, c=true)]", "[f(a=-3, b=1, c=false)]"]:
        assert accepts(tk, rf, text), text
    for text in ["[f()]", "[f(a=1)]", "[f(b=1, a=1)]", '[f(a="x", b=1)]', "[f(b=1, c=1)]", "[f(b=1), f(b=2)]"]:
        assert not accepts(tk, rf, text), text
    bad = [{"type": "function", "function": {"name": "g", "parameters": {"properties": {"first-name": {}}}}}]
    with pytest.raises(InputError, match=r"tools\[0\].function.parameters: property 'first-name' is not a Python"):
        tools.prepare(tk, tk.vocab_size, CONVERSATION[1:2], bad, "required")


@pytest.mark.parametrize("text, content, calls", [
    ('[f(x={"a": [1, true, null]}, y=-2.5, z=(1, "two"))]', None, [("f", {"x": {"a": [1, True, None]}, "y": -2.5,
                                                                            "z": [1, "two"]})]),
    ('<|python_start|>[get-weather(city="a, b)]")]<|python_end|>', None, [("get-weather", {"city": "a, b)]"})]),
    ("[f(x=1), 3]", None, [("f", {"x": 1})]),  # a later element that is no call is dropped
    ("[f(x=1)", None, [("f", {"x": 1})]),  # the list's bracket never came: the call still counts
    # Not calls: content, whole.
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("See [f(x=1)]", "See [f(x=1)]", []),
    ("[f(x=os.system('ls'))]", "[f(x=os.system('ls'))]", []),  # only literals; nothing is evaluated
    ("[f(1)]", "[f(1)]", []),  # positional arguments have no names
    ("[f(x=1", "[f(x=1", []),  # cut short
    ("[]", "[]", []),
])
def test_pythonic_calls_are_read_as_literals(text, content, calls):
    for size in (1, 4, len(text)):
        parser = tools.reader(tools.PYTHONIC)
        pieces = [p for i in range(0, len(text), size) for p in parser.feed(text[i:i + size])] + parser.close()
        assert "".join(p.text for p in pieces if isinstance(p, tools.Text)) == (content or "")
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == calls
    assert tools.parse(tools.PYTHONIC, text)[0] == content


# ---- Gemma: no system role ----

TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Weather?"}]
GEMMA_TEXT = ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
              "<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n")


def test_gemma_gets_the_system_message_folded_into_the_first_user_turn():
    gemma2 = full_byte_tokenizer((), template("gemma2"))
    with pytest.raises(Exception, match="System role not supported"):  # the template itself refuses it
        chat_template._compile(template("gemma2")).render(messages=TURNS, add_generation_prompt=True, bos_token="")
    folded = [{"role": "user", "content": "Be brief.\n\nHi"}, *TURNS[2:]]
    assert gemma2.apply_chat_template(TURNS) == gemma2.apply_chat_template(folded) == GEMMA_TEXT
    # Gemma 3's template folds it itself, the same way.
    assert full_byte_tokenizer((), template("gemma3")).apply_chat_template(TURNS) == GEMMA_TEXT
    assert full_byte_tokenizer((), template("vllm_gemma3_pythonic")).apply_chat_template(TURNS) == GEMMA_TEXT
    # The server's path (tools.prepare) and a template's own BOS.
    plan = tools.prepare(gemma2, gemma2.vocab_size, TURNS, None)
    assert gemma2.decode(plan.prompt) == GEMMA_TEXT and plan.format is None
    assert chat_template.render(template("gemma2"), TURNS, bos_token="<bos>") == "<bos>" + GEMMA_TEXT
    # No system message: nothing to fold.
    assert gemma2.apply_chat_template(TURNS[1:]) == GEMMA_TEXT.replace("Be brief.\n\n", "")


def test_a_system_message_alone_or_before_content_parts_is_folded_as_text():
    assert chat_template.fold_system(TURNS[:1]) == [{"role": "user", "content": "Be brief."}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert chat_template.fold_system(parts) == [{"role": "user", "content": [
        {"type": "text", "text": "Be brief.\n\n"}, {"type": "text", "text": "Hi"}]}]
    assert full_byte_tokenizer((), template("gemma2")).apply_chat_template(TURNS[:1]) == \
        "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


def test_a_refusal_the_fold_does_not_cure_names_both():
    gemma2 = full_byte_tokenizer((), template("gemma2"))
    with pytest.raises(InputError) as e:
        gemma2.apply_chat_template([TURNS[0], TURNS[1], TURNS[3]])  # two user turns in a row
    assert str(e.value) == ("chat template: Conversation roles must alternate user/assistant/user/assistant/... (with "
                            "the system message folded into the first user message, as the template refused it: "
                            "System role not supported)")


def test_mistral_puts_the_system_message_in_the_last_user_turn():
    nemo = full_byte_tokenizer((), template("mistral_nemo"))
    assert nemo.apply_chat_template(CONVERSATION[:2]) == "[INST]Be brief.\n\nWeather in Paris?[/INST]"
    assert "Be brief." not in nemo.apply_chat_template(tools.conversation(CONVERSATION), tools=TOOLS)
    # vLLM's variant tests `tools is defined` after defining it: its tool prompt comes even without tools.
    parallel = full_byte_tokenizer((), template("vllm_mistral_parallel")).apply_chat_template(CONVERSATION[:2])
    assert parallel.startswith("[INST] You are a helpful assistant that can call tools.")
    assert parallel.endswith("the user.\n\nBe brief.\n\nWeather in Paris?[/INST]")


# ---- a template's errors ----


@pytest.mark.parametrize("source, messages, words", [
    ("{% if %}", TURNS, "chat template line 1: Expected an expression, got 'end of statement block'"),
    ("ok\n{{ messages[0].content + 1 }}", TURNS, "chat template line 2: TypeError: can only concatenate str"),
    ("{{ messages[0].nope.deeper }}", TURNS, "chat template line 1: 'dict object' has no attribute 'nope'"),
    ("{{ raise_exception('No roles but user') }}", TURNS[1:], "chat template: No roles but user"),
    # Real templates' checks: Mistral's ids of 9 characters, Hermes' results that name their function.
    (template("mistral_nemo"), [CONVERSATION[1], {**CONVERSATION[2], "tool_calls": [{
        **CONVERSATION[2]["tool_calls"][0], "id": "call_1"}]}], "chat template: Tool call IDs should be alphanumeric"),
    (template("vllm_hermes"), [CONVERSATION[1], {"role": "tool", "tool_call_id": "unknown", "content": "sunny"}],
     "chat template: Tool response dicts require a 'name' key"),
])
def test_template_errors_are_input_errors_that_name_them(source, messages, words):
    tk = full_byte_tokenizer((), source)
    with pytest.raises(InputError) as e:
        tools.prepare(tk, tk.vocab_size, messages, None)
    assert str(e.value).startswith(words), str(e.value)


def test_hugging_face_template_features():
    """What Hugging Face's environment has: loop controls, {% generation %}, tojson's arguments,
    strftime_now; a tool call's arguments are a mapping that prints as JSON."""
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}{{ m.role }}"
              "{% endgeneration %};{% endfor %}{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}"
              "{{ strftime_now('%Y') }}{% for m in messages if m.tool_calls %}{% set a = m.tool_calls[0].function"
              ".arguments %}|{{ a }}|{{ a is mapping }}|{{ a.city }}{% endfor %}")
    text = chat_template.render(source, tools.conversation(CONVERSATION), tools=[{"b": 1, "a": "é"}])
    assert text == ('system;user;[{"a":"é","b":1}]' + datetime.now().strftime("%Y") +
                    '|{"city": "Paris", "days": 2}|True|Paris')
