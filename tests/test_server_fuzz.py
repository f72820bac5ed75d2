"""`mlxfun serve` fuzzed from its own OpenAPI schema with schemathesis: every operation gets valid
and invalid bodies (positive and negative generation, seeded), each answer is checked by
schemathesis' checks that apply and by ours: no 5xx, each 4xx is OpenAI's error object naming
the field at fault, each 200 has the choices asked for. Afterwards the server still answers a
plain request as `generate` does. The server runs a tiny random model (a byte-level tokenizer
with a tool-aware chat template) on a free port of 127.0.0.1, and every generation is bounded:
the server's default is MAX_TOKENS tokens and `bounded` clamps the fields that ask for more."""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import timedelta
from typing import Iterator

import pytest
import requests
import schemathesis
from helpers import full_byte_tokenizer, tiny_config, tiny_params
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import Server
from test_tools import QWEN_TEMPLATE

import mlxfun
from mlxfun.model.load import Model

CONTEXT = 2048  # the tiny model's context: a longer max_tokens must be refused
MAX_TOKENS = 4  # the server's default, and the most `bounded` lets a request ask for
MAX_N = 2  # choices per request at most, likewise
EXAMPLES = 80  # per operation with a body and generation mode: about 20 s in all (alone on 2 cores)
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}  # the body's required field


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Server, Model]]:
    """(server, the same model loaded here). Rows plus the queue take 12 requests, so a prompt list
    times n can ask for more than the server could ever take."""
    tokenizer = full_byte_tokenizer((), QWEN_TEMPLATE)
    config = tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=CONTEXT)
    params, _ = tiny_params(config, seed=5)
    folder = tmp_path_factory.mktemp("fuzz-model")
    mlxfun.save(Model(config, params, tokenizer, "tiny fuzz"), folder)
    server = Server("--model", str(folder), "--rows", "4", "--max-queued", "8", "--max-tokens", str(MAX_TOKENS),
                    "--temp", "0", log_path=folder / "log")
    try:
        yield server, mlxfun.load(str(folder))
    finally:
        server.stop()


def bounded(case: Case) -> None:
    """Clamp the fields that would generate long: max_tokens, max_completion_tokens and n within
    what the server accepts go down to MAX_TOKENS / MAX_N. Values it must refuse (too large for
    the context, n over 128, not positive integers) stay, so those checks are fuzzed too."""
    if not isinstance(case.body, dict):
        return
    for field, most, accepted in (("max_tokens", MAX_TOKENS, CONTEXT), ("max_completion_tokens", MAX_TOKENS, CONTEXT),
                                  ("n", MAX_N, 128)):
        v = case.body.get(field)
        if type(v) in (int, float) and most < v <= accepted and float(v).is_integer():  # 3.0 is 3 to the server
            case.body[field] = most


def sent(response: Response) -> object:
    """The body the request sent, as JSON; None when it was not JSON."""
    if "json" not in (response.request.headers.get("Content-Type") or ""):
        return None
    try:
        return json.loads(response.request.body or b"")
    except ValueError:
        return None


def check_openai_error(case: Case, response: Response) -> None:
    """A 4xx is OpenAI's error object. On the completion endpoints, a JSON object sent gets a
    `param` that the message names and that is a field of the request (or its required one);
    a body that is not a JSON object gets param null and a message about the body."""
    if not 400 <= response.status_code < 500:
        return
    assert response.headers["content-type"] == ["application/json"], response.headers
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"], body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    assert not re.search(r"Traceback|mlx\.core|\w+Error: ", error["message"]), error  # no stack, no internals
    if case.method.upper() != "POST":
        return
    request = sent(response)
    if not isinstance(request, dict):
        assert error["param"] is None and error["message"].startswith("the body "), (request, error)
        return
    param = error["param"]
    assert isinstance(param, str) and param in error["message"], (request, error)
    root = re.match(r"\w+", param).group()
    assert root in request or root == REQUIRED[case.path], (request, error)


def rows_asked(path: str, request: dict) -> int:
    """Choices a valid request gets: n per prompt (chat: one conversation)."""
    prompt = request.get("prompt")
    prompts = 1 if path == "/v1/chat/completions" or isinstance(prompt, str) or isinstance(prompt[0], (int, float)) \
        else len(prompt)  # token ids (0.0 is one too) or a list of prompts
    return prompts * int(request.get("n", 1))


def check_answer(case: Case, response: Response) -> None:
    """A completion's 200 has one choice per row asked (streamed: each index, then [DONE], no
    error event), and no more tokens than its max_tokens allows."""
    if response.status_code != 200 or case.method.upper() != "POST":
        return
    request = sent(response)
    rows = rows_asked(case.path, request)
    if request.get("stream"):
        events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
        assert not response.stream_cut_short and events and events[-1] == "[DONE]", response.text[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), response.text[-300:]
        assert {c["index"] for chunk in chunks for c in chunk["choices"]} == set(range(rows))
        return
    out = response.json()
    chat = case.path == "/v1/chat/completions"  # where max_completion_tokens, when given, overrides max_tokens
    limit = (chat and request.get("max_completion_tokens")) or request.get("max_tokens") or MAX_TOKENS
    assert [c["index"] for c in out["choices"]] == list(range(rows)), out
    assert 0 < out["usage"]["completion_tokens"] <= rows * limit, out


def fuzz(operation, mode: GenerationMode, url: str, session: requests.Session, statuses: Counter) -> None:
    """`EXAMPLES` cases of one operation (derandomized: the same cases every run), each checked."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]

    @settings(max_examples=EXAMPLES if operation.body else 3, derandomize=True, database=None,
              deadline=timedelta(seconds=30), phases=(Phase.explicit, Phase.generate, Phase.shrink),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(case=operation.as_strategy(mode))
    def one(case: Case) -> None:
        bounded(case)
        response = case.call(base_url=url, session=session, timeout=60)
        statuses[operation.label, response.status_code] += 1
        case.validate_response(response, checks=checks)
        check_openai_error(case, response)
        check_answer(case, response)

    one()


def test_fuzzed_requests_get_no_5xx_and_4xx_name_the_field(served):
    server, model = served
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    session = requests.Session()
    statuses: Counter = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(op.label for op in operations) == ["GET /health", "GET /metrics", "GET /v1/models",
                                                     "POST /v1/chat/completions", "POST /v1/completions"]
    for operation in operations:
        for mode in GenerationMode:
            if mode is GenerationMode.POSITIVE or operation.body:  # no parameters: nothing to make invalid
                fuzz(operation, mode, server.url, session, statuses)
    # Both outcomes were reached on both endpoints: generation past the checks, and refusals.
    for path in REQUIRED:
        assert statuses[f"POST {path}", 200] >= 5 and statuses[f"POST {path}", 400] >= EXAMPLES, statuses
    assert {status for (_, status) in statuses} <= {200, 400}, statuses

    # Still alive, and still right: plain requests answer what `generate` gives offline.
    assert server.proc.poll() is None
    assert session.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    r = session.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
                     timeout=60)
    want = mlxfun.generate(model, "Hello", max_tokens=4, ignore_eos=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.texts[0]
    assert r.json()["usage"]["completion_tokens"] == 4
    messages = [{"role": "user", "content": "Hi there"}]
    r = session.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
    want = mlxfun.generate(model, [messages], max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.texts[0]
    assert r.json()["usage"]["completion_tokens"] == len(want.token_ids[0])


def test_requests_for_more_choices_than_the_server_holds_get_400_naming_n(served):
    """More choices than the rows and the queue hold (4 + 8) could never run: a 400, not a 429 to
    retry; past OpenAI's 128 the choices are refused before any is built."""
    server, _ = served
    session = requests.Session()
    r = session.post(server.url + "/v1/completions", json={"prompt": ["a b"] * 7, "n": 2, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    message = r.json()["error"]["message"]
    assert message == "n: the request asks for 14 choices (7 prompts, n=2); this server takes 12 at once"
    r = session.post(server.url + "/v1/completions", json={"prompt": "a", "n": 10**9}, timeout=60)  # not built first
    assert r.status_code == 400 and r.json()["error"]["message"] == "n must be at most 128, got 1000000000"


def test_choices_of_the_last_seed_wrap_to_seed_0(served):
    """The schema's largest seed with n=2: choice 1 samples with seed 0 (seeds wrap at 2**32)."""
    server, model = served
    body = {"prompt": "Hello", "n": 2, "seed": 2**32 - 1, "temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for choice, seed in zip(r.json()["choices"], (2**32 - 1, 0)):
        want = mlxfun.generate(model, "Hello", max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)
        assert choice["text"] == want.texts[0]
