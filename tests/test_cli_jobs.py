"""The command line run as a user runs it (subprocesses), on a tiny saved model with a chat template:
JSONL datasets in and out, resume after Ctrl-C, streaming, stdin, chat by default, every flag."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_chat_model, tiny_config

import mlxfun
from mlxfun.cli.main import generation_config, main
from mlxfun.engine.options import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    # A long context, so that a prompt can generate for as long as a test needs.
    model = tiny_chat_model(tiny_config(max_position_embeddings=1 << 20), seed=3)
    return str(mlxfun.save(model, tmp_path_factory.mktemp("cli") / "tiny"))


def cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxfun", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_in_and_out(folder, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "w5 w6"},
        "w7 w8 w9",  # no id: its line number
        {"id": 7, "messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w4"}]},
        {"id": "hot", "prompt": "w5 w6", "max_tokens": 3, "temperature": 0.9, "seed": 11},
    ])
    out = tmp_path / "out.jsonl"
    run = cli("generate", "--model", folder, "--prompts-file", str(data), "--output", str(out), "-m", "6",
              "--ignore-eos", "--logprobs", "2", "--batch-size", "2")
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    lines = {r["id"]: r for r in read_jsonl(out)}
    assert set(lines) == {"a", 2, 7, "hot"}  # ids as given (their JSON types kept), else the line number
    assert {k: r["line"] for k, r in lines.items()} == {"a": 1, 2: 2, 7: 3, "hot": 4}
    assert lines["a"]["prompt"] == "w5 w6" and lines[7]["messages"][1] == {"role": "user", "content": "w4"}
    # The chat template is on by default: "w2 w5 w6 w3"; the system message adds "w1 w1".
    assert [lines[k]["prompt_tokens"] for k in ("a", 2, 7, "hot")] == [4, 5, 5, 4]
    assert [lines[k]["completion_tokens"] for k in ("a", 2, 7, "hot")] == [6, 6, 6, 3]  # --ignore-eos; max_tokens
    assert all(r["finish_reason"] == "length" for r in lines.values())
    assert lines["hot"]["seed"] == 11 and "seed" not in lines["a"]
    for r in lines.values():  # token texts make up the text; the top-2 are sorted, the greedy pick is the first
        assert " ".join(t["token"] for t in r["logprobs"]) == r["text"]
        for t in r["logprobs"]:
            assert [x["token"] for x in t["top_logprobs"]] == [f"w{x['id']}" if x["id"] else "<|endoftext|>"
                                                               for x in t["top_logprobs"]]
            assert t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"]
            if r["id"] != "hot":
                assert t["top_logprobs"][0]["id"] == t["id"] and t["logprob"] == pytest.approx(
                    t["top_logprobs"][0]["logprob"])
    progress = [line for line in run.stderr.splitlines() if line.startswith("progress: ")]
    assert progress[-1].startswith("progress: 4/4 done (100%)") and "tok/s, ETA" in progress[-1]
    assert len(progress) == 4  # not a terminal: one plain line per finished prompt (of 4)


def test_resume_after_sigint(folder, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"w{i} w{i + 1}"} for i in range(1, 41)])
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", folder, "--prompts-file", str(data), "--output", str(out), "-m", "60",
            "--ignore-eos", "--batch-size", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "mlxfun", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    deadline = time.time() + 120
    while (not out.exists() or out.read_text().count("\n") < 2) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    first = read_jsonl(out)  # every line whole
    assert 2 <= len(first) < 40
    assert f"interrupted: {len(first)} of 40 prompts are in {out}" in stderr
    assert "mlxfun generate --model" in stderr.splitlines()[-1]  # the command to resume
    kept = out.read_text()
    with open(out, "a") as f:
        f.write('{"id": "q40", "text": "w1')  # a line cut short, as a killed job may leave
    run = cli(*args)
    assert run.returncode == 0, run.stderr
    assert f"resuming: {len(first)} of 40" in run.stderr and "cut short" in run.stderr
    assert out.read_text().startswith(kept)
    ids = [r["id"] for r in read_jsonl(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(1, 41))  # each exactly once
    assert all(r["completion_tokens"] == 60 for r in read_jsonl(out))
    again = cli(*args)
    assert again.returncode == 0 and "all 40 prompts are already in" in again.stderr


def test_malformed_jsonl_names_the_line(folder, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "w1"}\n\n{"prompt": "w2",}\n')
    run = cli("generate", "--model", folder, "--prompts-file", str(data))
    assert run.returncode == 2
    assert run.stderr.startswith(f"mlxfun: error: {data}:3: not valid JSON") and "Traceback" not in run.stderr


@pytest.mark.parametrize("line, message", [
    ({"prompt": "w1", "temperature": -1}, "temperature must be a non-negative number, got -1"),
    ({"prompt": "w1", "max_token": 3}, "unknown key 'max_token' (did you mean 'max_tokens'?"),
    ({"prompt": "w1", "max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
    ({"prompt": "w1", "seed": "x"}, "seed must be an integer in [0, 2**32), got 'x'"),
    ({"id": "a", "prompt": "w1"}, "id 'a' is also the id of"),
    ({"messages": [{"role": "robot", "content": "w1"}]}, "message 0 has unknown role 'robot'"),
    ({"text": "w1"}, "give one of 'prompt'"),
    ({"prompt": "w1", "max_tokens": [1, 2]}, "max_tokens must be one value, got [1, 2]"),
    ({"prompt": "w1", "stop": ["w2", 3.5]}, "stop must be one value"),
])
def test_line_errors(folder, tmp_path, capsys, line, message):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "w3"}, line])
    assert main(["generate", "--model", folder, "--prompts-file", str(data), "-m", "2", "-o",
                 str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mlxfun: error: {data}:2: ") and message in err, err


def test_text_file_ids_are_line_numbers(folder, tmp_path):
    data = tmp_path / "in.txt"
    data.write_text("w5 w6\n\nw7\n")
    out = tmp_path / "out.jsonl"
    run = cli("generate", "--model", folder, "--prompts-file", str(data), "-o", str(out), "-m", "2",
              "--ignore-chat-template")
    assert run.returncode == 0, run.stderr
    assert sorted((r["id"], r["line"], r["prompt"], r["prompt_tokens"]) for r in read_jsonl(out)) == [
        (1, 1, "w5 w6", 2), (3, 3, "w7", 1)]


def test_prompt_ids_are_one_scheme(folder, tmp_path, capsys):
    """-p prompts are 1, 2, ... in order, in the output file (no line), the printed headers and
    the ring warning; a file's prompts are named by their ids there too; resume keeps working."""
    out = tmp_path / "out.jsonl"
    common = ["generate", "--model", folder, "-m", "2", "--ignore-chat-template"]
    assert main([*common, "-p", "w5 w6", "-p", "w7", "-o", str(out)]) == 0
    assert sorted((r["id"], r["prompt"]) for r in read_jsonl(out)) == [(1, "w5 w6"), (2, "w7")]
    assert all("line" not in r for r in read_jsonl(out))
    assert main([*common, "-p", "w5 w6", "-p", "w7", "-p", "w8", "-o", str(out)]) == 0
    assert "resuming: 2 of 3 prompts are already in" in capsys.readouterr().err
    assert sorted(r["id"] for r in read_jsonl(out)) == [1, 2, 3]
    long = " ".join(f"w{i}" for i in range(10, 23))  # 13 tokens: more than the ring of 8 and 4 sinks
    assert main([*common, "-p", "w5", "-p", long, "--max-kv-size", "8"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("====")] == [
        "==== prompt 1 (length) ====", "==== prompt 2 (length) ===="]
    assert "--max-kv-size 8 is shorter than prompt 2 (13 tokens): each token sees only the first 4 and the last " \
           "8" in captured.err
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "w5"}, long, {"id": "1", "prompt": "w6"}])
    assert main([*common, "--prompts-file", str(data), "--max-kv-size", "8"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("====")] == [
        "==== prompt x (length) ====", "==== prompt 2 (length) ====", "==== prompt 1 (length) ===="]
    assert "shorter than prompt 2 (13 tokens)" in captured.err
    both = tmp_path / "both.jsonl"
    assert main([*common, "--prompts-file", str(data), "-o", str(both)]) == 0
    assert sorted(((r["id"], r["line"]) for r in read_jsonl(both)), key=str) == [("1", 3), ("x", 1), (2, 2)]
    assert main([*common, "--prompts-file", str(data), "-o", str(both)]) == 0  # "1" and 1 are different ids
    assert "all 3 prompts are already in" in capsys.readouterr().err
    assert main([*common, "--prompts-file", str(data), "-p", "w5"]) == 2
    assert "give --prompt (-p) or --prompts-file, not both" in capsys.readouterr().err


def test_stdin_prompt_chat_by_default_and_system_prompt(folder):
    def prompt_tokens(*flags):
        run = cli("generate", "--model", folder, "-p", "-", "-m", "3", "--ignore-eos", "--verbose", *flags,
                  stdin="w5 w6\n")
        assert run.returncode == 0, run.stderr
        assert len(run.stdout.split("==========")[0].split()) == 3  # the streamed text: 3 words
        return int(run.stdout.split("Prompt: ")[1].split()[0])

    assert prompt_tokens() == 4  # w2 w5 w6 w3: stdin without its newline, through the template
    assert prompt_tokens("--ignore-chat-template") == 2
    assert prompt_tokens("--system-prompt", "w9") == 6


def test_one_prompt_streams_and_stops_on_ctrl_c(folder):
    proc = subprocess.Popen([sys.executable, "-m", "mlxfun", "generate", "--model", folder, "-p", "w5", "-m", "100000",
                             "--ignore-eos", "--max-kv-size", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    first = os.read(proc.stdout.fileno(), 100)  # text arrives while the prompt is still generating
    assert first.startswith(b"w") and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"Traceback" not in stderr
    assert b"interrupted: 0 of 1 prompts finished" in stderr
    assert (first + stdout).endswith(b"\n") and len((first + stdout).split()) > 1


# Two groups of flags and the same options for the API. Each option changes these prompts' output
# (checked below), so a flag that did not reach the generation would show.
FLAG_GROUPS = {
    "sampling": (["--temp", "1", "--top-k", "5", "--top-p", "0.8", "--min-p", "0.2", "--seed", "0", "--ignore-eos",
                  "--logprobs", "1"],
                 dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.2, seed=0, ignore_eos=True, logprobs=1),
                 dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)),
    "penalties": (["--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.3",
                   "--stop", "w80", "--extra-eos-token", "w68", "--max-kv-size", "8", "--prefill-step", "3",
                   "--batch-size", "2", "--logprobs", "0"],
                  dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, stop="w80",
                       extra_eos_tokens=("w68",), max_kv_size=8, prefill_step=3, batch_size=2, logprobs=0),
                  dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, stop=None,
                       extra_eos_tokens=(), max_kv_size=None)),
}


@pytest.mark.parametrize("group", FLAG_GROUPS)
def test_every_flag_reaches_generation(folder, tmp_path, group):
    """A job with the flags gives exactly what the API gives with the same options."""
    flags, options, off = FLAG_GROUPS[group]
    data = write_jsonl(tmp_path / "in.jsonl", ["w5 w6", "w7 w8 w9", "w10"])
    out = tmp_path / "out.jsonl"
    run = cli("generate", "--model", folder, "--prompts-file", str(data), "-o", str(out), "-m", "16", *flags)
    assert run.returncode == 0, run.stderr
    got = sorted(read_jsonl(out), key=lambda r: r["id"])
    model = mlxfun.load(folder)
    prompts = [[{"role": "user", "content": p}] for p in ("w5 w6", "w7 w8 w9", "w10")]
    config = GenerationConfig(max_tokens=16, **options)
    want = mlxfun.generate(model, prompts, config)
    assert [r["text"] for r in got] == want.texts
    assert [r["finish_reason"] for r in got] == want.finish_reasons
    assert [[t["id"] for t in r["logprobs"]] for r in got] == want.token_ids
    assert np.allclose([t["logprob"] for r in got for t in r["logprobs"]], [x for r in want.logprobs for x in r])
    for name, value in off.items():  # each option matters here
        assert mlxfun.generate(model, prompts, config, **{name: value}).token_ids != want.token_ids, name


def test_ignore_eos_generates_max_tokens(folder, tmp_path):
    out = tmp_path / "out.jsonl"
    # Greedy, this prompt repeats w68: as an EOS token it ends the row at once, unless EOS is ignored.
    args = ["generate", "--model", folder, "-p", "w5 w6", "-o", str(out), "-m", "12", "--extra-eos-token", "w68"]
    assert cli(*args).returncode == 0
    assert [read_jsonl(out)[0][k] for k in ("completion_tokens", "finish_reason")] == [0, "stop"]
    out.unlink()
    assert cli(*args, "--ignore-eos").returncode == 0
    assert [read_jsonl(out)[0][k] for k in ("text", "finish_reason")] == [" ".join(["w68"] * 12), "length"]


def test_every_generation_option_has_a_flag():
    from mlxfun.cli.main import generate_parser

    parser = argparse.ArgumentParser()
    generate_parser(parser)
    args = parser.parse_args(["-m", "9", "--temp", "0.5", "--top-p", "0.9", "--min-p", "0.1", "--top-k", "4",
                              "--seed", "2", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
                              "--frequency-penalty", "0.3", "--stop", "x", "--extra-eos-token", "w1", "7",
                              "--ignore-eos", "--logprobs", "3", "--max-kv-size", "64", "--prefill-step", "16",
                              "--batch-size", "5", "--no-prefix-cache", "--prompt-cache-file", "p.safetensors",
                              "--draft-model", "prompt-lookup", "--num-draft-tokens", "3",
                              "--response-format", '{"type": "json_object"}', "--batch-invariant"])
    config, default = generation_config(args), GenerationConfig()
    changed = {f for f in GenerationConfig.__dataclass_fields__ if getattr(config, f) != getattr(default, f)}
    # chat: --ignore-chat-template; group: --data-parallel (a group exists once the ranks are launched)
    assert changed == set(GenerationConfig.__dataclass_fields__) - {"chat", "group"}
    assert parser.parse_args(["--data-parallel"]).data_parallel
    assert config.extra_eos_tokens == ("w1", "7") and config.max_tokens == 9


def test_help_version_and_flag_errors(folder, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--stream"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mlxfun generate") and "unrecognized arguments: --stream" in err
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"mlxfun {mlxfun_version()}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-tokens MAX_TOKENS tokens to generate per prompt (default: 256)", "(default: 0.0)",
                 "--top-p TOP_P nucleus", "--prefill-step TOKENS prompt tokens per prefill chunk (default: 512)"):
        assert flag in text
    assert main(["generate", "--model", folder, "-p", "w1", "--temp", "-1"]) == 2
    assert "mlxfun: error: --temp must be a non-negative number, got -1.0" in capsys.readouterr().err
    assert main(["generate", "--model", folder, "-p", "w1", "--extra-eos-token", "nope"]) == 2
    assert "--extra-eos-token has 'nope', which is not one token" in capsys.readouterr().err
    assert main(["generate", "--model", folder, "-p", "w1", "--system-prompt", "w2", "--ignore-chat-template"]) == 2
    assert "--system-prompt needs the chat template" in capsys.readouterr().err


def mlxfun_version() -> str:
    from importlib.metadata import version

    return version("mlxfun")


def test_perplexity_command(folder):
    text = " ".join(f"w{(i * 7) % 90 + 1}" for i in range(40))
    run = cli("perplexity", "--model", folder, "--sequence-length", "64", stdin=text)
    assert run.returncode == 0, run.stderr
    model = mlxfun.load(folder)
    (logprobs,) = mlxfun.score(model, text)
    want = math.exp(-float(np.mean(np.array(logprobs, dtype=np.float64))))
    assert float(run.stdout.split()[1]) == pytest.approx(want, abs=2e-3)
    assert "Tokens: 39 scored in 1 windows" in run.stdout and "tokens/s" in run.stdout


def test_perplexity_windows_are_scored_alone():
    from mlxfun.model.score import perplexity

    model = tiny_chat_model(seed=4)
    text = " ".join(f"w{(i * 5) % 90 + 1}" for i in range(23))
    got = perplexity(model, text, sequence_length=10, batch_size=2)  # windows of 10, 10, 3 tokens
    parts = [" ".join(text.split()[i:i + 10]) for i in (0, 10, 20)]
    nll = -np.concatenate([np.array(lp) for lp in mlxfun.score(model, parts)])
    assert (got.tokens, got.windows) == (20, 3)
    assert got.perplexity == pytest.approx(math.exp(nll.mean()), rel=1e-5)


def test_progress_bar_on_a_terminal_and_lines_elsewhere():
    import io

    from mlxfun.cli.progress import Progress

    term = io.StringIO()
    bar = Progress(40, 10, stream=term, tty=True)
    bar._last = 0.0  # the bar redraws at most every 0.1 s: due now
    bar.update(tokens=50, finished=10)
    shown = term.getvalue()
    assert shown.startswith("\r\x1b[K[" + "#" * 12 + "." * 12 + "] 20/40 done (50%), 50 tokens,") and "ETA " in shown
    bar.clear()
    assert term.getvalue().endswith("\r\x1b[K")
    bar.close()
    assert term.getvalue().endswith("\n") and "\n" not in shown

    log = io.StringIO()
    lines = Progress(100, stream=log, tty=False, interval=3600)
    for _ in range(10):
        lines.update(tokens=0, finished=1)
    # One line per twentieth of the job (5 requests).
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == ["progress: 5/100 done (5%)",
                                                                             "progress: 10/100 done (10%)"]
    lines.close()
    assert log.getvalue().splitlines()[-1].startswith("progress: 10/100 done (10%)")  # no repeat of the same count
    assert len(log.getvalue().splitlines()) == 2


class Clock:
    """A stand-in for `time` in mlxfun.cli.progress: perf_counter reads `now`."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_eta_waits_for_three_requests_then_moves_smoothly(monkeypatch):
    import io

    from mlxfun.cli import progress

    clock = Clock()
    monkeypatch.setattr(progress, "time", clock)
    bar = progress.Progress(100, stream=io.StringIO(), tty=False)
    etas = []
    for seconds in (1, 1, 1, 1, 100):  # a request a second, then one after 100 s
        clock.now += seconds
        bar.update(tokens=0, finished=1)
        etas.append(bar.line().rsplit("ETA ", 1)[1])
    assert etas[:2] == ["?", "?"]  # fewer than 3 requests: no estimate yet
    assert etas[2:4] == ["0:01:37", "0:01:36"]  # 1 s a request, 97 then 96 left
    # Raw: 104 s / 5 * 95 = 1976 s from now; shown: the end moves 0.3 of the way there from 96 s.
    assert etas[4] == progress._clock((1 - 0.3) * (96 - 100) + 0.3 * 1976)
    bar.update(tokens=0, finished=95)
    assert bar.line().endswith("ETA 0:00:00")


def test_a_prompt_cache_no_prompt_can_use_warns(folder, tmp_path, capsys):
    cache = tmp_path / "system.safetensors"
    system = " ".join(f"w{i}" for i in range(10, 50))  # two whole blocks once templated
    assert main(["cache-prompt", "--model", folder, "--system-prompt", system, "-o", str(cache)]) == 0
    common = ["generate", "--model", folder, "-m", "2", "--prompt-cache-file", str(cache), "-p", "w5 w6"]
    capsys.readouterr()
    assert main([*common, "--system-prompt", system]) == 0
    assert "warning" not in capsys.readouterr().err  # the cached system prompt starts the prompt
    assert main(common) == 0
    err = capsys.readouterr().err
    assert f"warning: the prompt cache {cache} is unused: no prompt starts with its first 16 tokens" in err
    short = tmp_path / "short.safetensors"
    assert main(["cache-prompt", "--model", folder, "-p", "w5 w6", "-o", str(short)]) == 0
    assert main([*common[:-4], "--prompt-cache-file", str(short), "-p", "w5 w6"]) == 0
    assert f"the prompt cache {short} is unused: it holds 2 tokens, less than one block of 16" in \
        capsys.readouterr().err


def test_chat_has_no_batch_size_or_logprobs(capsys):
    from mlxfun.cli import chat

    for flag in ("--batch-size", "--logprobs"):
        with pytest.raises(SystemExit) as done:
            chat.parse_args([flag, "2"])
        assert done.value.code == 2 and f"unrecognized arguments: {flag} 2" in capsys.readouterr().err
    config = generation_config(chat.parse_args(["-m", "5"]))
    assert (config.max_tokens, config.batch_size, config.logprobs) == (5, None, None)


@pytest.mark.parametrize("line, column", [('{"prompt": "w2"', "column 16, the line's end"),
                                          ('{"prompt": "w2",', "column 17, the line's end"),
                                          ('{"prompt": "w2",}', "column 17)")])
def test_json_error_column_is_on_the_line(folder, tmp_path, capsys, line, column):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "w1"}\n' + line + "\n")
    assert main(["generate", "--model", folder, "--prompts-file", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mlxfun: error: {data}:2: not valid JSON") and f"({column}" in err, err
