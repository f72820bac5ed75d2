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


# The same bench with `--mlx-lm` against a stand-in `mlx_lm` module (mlx-lm is never installed for
# the tests) whose batch_generate fails at 4 rows, as the real one did on CUDA at 128 rows of a
# Qwen3-MoE shape: mlxfun's rows and mlx-lm's figures before the failure are kept and written.
SIDE_FAILS = """
import importlib.machinery, sys, types
sys.path.insert(0, "tests")
from helpers import tiny_config
from mlxfun.bench import main as bench
from mlxfun.cli.main import main

class Stats:
    prompt_tokens, prompt_time, generation_tps = 4, 0.5, 100.0

def batch_generate(model, tokenizer, prompts, max_tokens, **options):
    if len(prompts) == 4:
        raise RuntimeError("cuGraphAddKernelNode(...) failed: invalid argument")
    return types.SimpleNamespace(stats=Stats())

fake = types.ModuleType("mlx_lm")
fake.__spec__ = importlib.machinery.ModuleSpec("mlx_lm", None)
fake.load = lambda folder: (None, types.SimpleNamespace())
fake.batch_generate = batch_generate
sys.modules["mlx_lm"] = fake
bench.SHAPES["135M"] = tiny_config(num_layers=2)
sys.exit(main(["bench", "--shape", "135M", "--dtypes", "float32", "--batch-sizes", "1,4,8", "--prompt-tokens", "4",
               "--gen-tokens", "3", "--mlx-lm", "--json", sys.argv[1]]))
"""


def test_a_failing_mlx_lm_keeps_every_row(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-c", SIDE_FAILS, str(out)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "mlx-lm float32   batch    4: failed (RuntimeError: cuGraphAddKernelNode" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mlx_lm_gen_tps"], r["mlx_lm_error"] is None) for r in rows] == [
        (1, 100.0, True), (4, None, False), (8, None, False)]
    assert all(r["gen_tps"] > 0 for r in rows)
    assert rows[0]["ratio"] == rows[0]["gen_tps"] / 100.0
    table = run.stdout[run.stdout.index("weights "):].splitlines()
    assert table[3].split()[-2:] == ["failed", "-"] and table[4].split()[-2:] == ["failed", "-"]
