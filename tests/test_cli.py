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
    assert headers == ["==== prompt 0 (length) ====", "==== prompt 1 (length) ====", "==== prompt 2 (length) ===="]


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
