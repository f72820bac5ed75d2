"""`mlxfun bench` as a user meets it: every default in --help, CPU defaults sized for a CPU, and a
Ctrl-C that keeps the rows already measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlxfun.bench import main as bench

ROOT = Path(__file__).resolve().parents[1]


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # One entry per flag (an entry's first line starts "  -"), its wrapped lines joined.
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=-)", out[out.index("options:"):])[1:]}
    for flag, default in (("--batch-sizes", "(default: 1,2,4,8,16,32,64,128 on a GPU, 1,4 on the CPU)"),
                          ("--prompt-tokens", "(default: 128 on a GPU, 16 on the CPU)"),
                          ("--gen-tokens", "(default: 128 on a GPU, 16 on the CPU)"),
                          ("--repeats", "(default: 1)"), ("--strategy", "(default: auto)"),
                          ("--prompts", "(default: 256)"), ("--rows", "(default: 32)"),
                          ("--alphas", "(default: 0.5,0.7,0.9)"), ("--json", "(default: none)")):
        assert default in entries[flag], entries[flag]
    for flag, entry in entries.items():  # every flag that takes a value says its default
        if flag not in ("-h,", "--tensor-parallel") and entry.split()[1].isupper():
            assert "default" in entry, entry


def test_cpu_defaults():
    args = bench.parse_args([])
    assert (args.batch_sizes, args.prompt_tokens, args.gen_tokens) == ([1, 4], 16, 16)  # the tests run on the CPU
    args = bench.parse_args(["--batch-sizes", "2,8", "--prompt-tokens", "32"])
    assert (args.batch_sizes, args.prompt_tokens, args.gen_tokens) == ([2, 8], 32, 16)


def test_bad_batch_sizes_name_the_flag(capsys):
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--batch-sizes", "1,x"])
    assert done.value.code == 2 and "--batch-sizes must be comma-separated integers" in capsys.readouterr().err


# Runs `mlxfun bench` on a tiny random shape, with Ctrl-C (KeyboardInterrupt) raised by the first
# run of the second configuration (batch 2), as SIGINT would raise it between two steps.
CTRL_C = """
import sys
sys.path.insert(0, "tests")
from helpers import tiny_config
from mlxfun.bench import main as bench
from mlxfun.cli.main import main

bench.SHAPES["135M"] = tiny_config(num_layers=2)
measured = bench.run_batch

def run_batch(model, prompts, max_tokens, strategy):
    if len(prompts) == 2:
        raise KeyboardInterrupt
    return measured(model, prompts, max_tokens, strategy)

bench.run_batch = run_batch
sys.exit(main(["bench", "--shape", "135M", "--dtypes", "float32", "--batch-sizes", "1,2,4", "--prompt-tokens", "4",
               "--gen-tokens", "3", "--json", sys.argv[1]]))
"""


def test_ctrl_c_keeps_the_rows_measured(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-c", CTRL_C, str(out)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 130, run.stderr
    assert "Traceback" not in run.stderr and "interrupted: 1 row(s) measured" in run.stderr
    table = run.stdout[run.stdout.index("weights "):].splitlines()
    assert len(table) == 4 and table[2].split()[:2] == ["float32", "1"]  # head, rule, the row of batch 1, "written"
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert [(r["weights"], r["batch"]) for r in result["rows"]] == [("float32", 1)]
    assert result["rows"][0]["gen_tps"] > 0
