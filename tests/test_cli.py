"""The command line, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from mlxfun.cli.main import main


def test_generate_one_prompt_verbose(capsys):
    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--verbose",
                 "--ignore-chat-template"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" Paris")
    assert "Prompt: 5 tokens" in out and "Generation: 4 tokens" in out and "Peak memory:" in out


def test_generate_prompts_file_jsonl_chat(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        "The capital of France is", {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "Hi"}]}]) + "\n")
    assert main(["generate", "--prompts-file", str(path), "--max-tokens", "3", "--temp", "0.8", "--seed", "1",
                 "--batch-size", "2", "--ignore-chat-template"]) == 0  # text prompts raw (short): fast
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("==== prompt")]
    assert headers == ["==== prompt 1 (length) ====", "==== prompt 2 (length) ====", "==== prompt 3 (length) ===="]


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxfun: error: no such model file or folder") and "Traceback" not in err
    assert main(["generate", "--prompt", "x", "--top-p", "1.5"]) == 2
    assert "--top-p must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["generate"]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    run = subprocess.run([sys.executable, "-m", "mlxfun", "generate", "--prompt", "Hello", "--max-tokens", "2",
                          "--ignore-chat-template"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def logprob_tables(out: str) -> list[list[tuple[str, float, list[tuple[str, float]]]]]:
    """Each printed logprobs table: per line (token, logprob, [(alternative, logprob)])."""
    tables = []
    for line in out.splitlines():
        if line.startswith("---- logprobs"):
            tables.append([])
        elif tables and line.startswith('"'):
            tables[-1].append(table_line(line))
    return tables


def table_line(line: str) -> tuple[str, float, list[tuple[str, float]]]:
    """'"tok"  -0.1234  | "a"=-0.1  "b"=-2.0', read token by token (a token may hold spaces or '|')."""
    decode = json.JSONDecoder().raw_decode
    token, at = decode(line)
    number, _, rest = line[at:].strip().partition("  | ")
    top = []
    while rest:
        alt, at = decode(rest)
        value, _, rest = rest[at + 1:].partition("  ")  # skip '='
        top.append((alt, float(value)))
    return token, float(number), top


def test_generate_prints_logprobs_without_output_file(capsys, model_q4):
    import mlxfun

    prompts = ["The capital of France is", "1, 2, 3,"]
    want = mlxfun.generate(model_q4, prompts, max_tokens=3, logprobs=2, ignore_eos=True)  # str prompts: raw text
    for argv, rows in ((["-p", prompts[0]], [0]), (["-p", prompts[0], "-p", prompts[1]], [0, 1])):
        assert main(["generate", *argv, "-m", "3", "--logprobs", "2", "--ignore-eos", "--ignore-chat-template"]) == 0
        tables = logprob_tables(capsys.readouterr().out)
        assert len(tables) == len(rows)
        for table, row in zip(tables, rows):
            assert len(table) == 3  # one line per generated token
            ids = want.token_ids[row]
            assert [t for t, _, _ in table] == [model_q4.tokenizer.decode([i]) for i in ids]
            for (_, lp, top), w, wtop in zip(table, want.logprobs[row], want.top_logprobs[row]):
                assert abs(lp - w) <= 1e-4
                assert [t for t, _ in top] == [model_q4.tokenizer.decode([i]) for i, _ in wtop]
                assert all(abs(v - wv) <= 1e-4 for (_, v), (_, wv) in zip(top, wtop))


def test_a_ring_shorter_than_the_prompt_is_warned_of(capsys):
    """A prompt longer than the ring and its 4 sinks is warned of, by its id (-p: 1-based)."""
    prompt = "The capital of France is a city"  # 7 tokens
    assert main(["generate", "--prompt", prompt, "--max-tokens", "1", "--max-kv-size", "2",
                 "--ignore-chat-template"]) == 0
    err = capsys.readouterr().err
    assert "mlxfun: warning: --max-kv-size 2 is shorter than prompt 1 (7 tokens): each token sees only the first " \
           "4 and the last 2" in err
    assert main(["generate", "--prompt", prompt, "--max-tokens", "1", "--max-kv-size", "3",
                 "--ignore-chat-template"]) == 0
    assert "warning" not in capsys.readouterr().err
