"""`mlxfun chat` through a pseudo-terminal, as a user types it: turns, /stats, /reset, Ctrl-D."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_chat_model, tiny_model

import mlxfun

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[prompt (\d+) tokens, (\d+) cached, (\d+) computed; generated (\d+) tokens")


class Terminal:
    """A command on a pseudo-terminal (stdin, stdout and stderr), read up to a marker at a time."""

    def __init__(self, args: list[str]):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True,
                                     env=dict(os.environ, TERM="dumb"))  # dumb: readline writes no escapes
        os.close(slave)
        self.buffer = b""

    def read_until(self, marker: bytes, timeout: float = 60) -> str:
        deadline = time.time() + timeout
        while marker not in self.buffer:
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.time()))
            if not ready:
                raise TimeoutError(f"no {marker!r} after {timeout} s; got {self.buffer!r}")
            try:
                self.buffer += os.read(self.master, 4096)
            except OSError:  # the command has exited
                raise AssertionError(f"exited ({self.proc.wait()}) before {marker!r}: {self.buffer!r}") from None
        end = self.buffer.index(marker) + len(marker)
        out, self.buffer = self.buffer[:end], self.buffer[end:]
        return out.decode().replace("\r\n", "\n")

    def say(self, line: str) -> str:
        """Type a line; -> what the terminal shows until the next prompt (the echo of the line first)."""
        os.write(self.master, line.encode() + b"\n")
        return self.read_until(b">> ")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def chat(tmp_path):
    folder = mlxfun.save(tiny_chat_model(seed=3), tmp_path / "tiny")
    terminals = []

    def start(*flags: str) -> Terminal:
        terminals.append(Terminal([sys.executable, "-m", "mlxfun", "chat", "--model", str(folder), *flags]))
        return terminals[-1]

    yield start
    for t in terminals:
        t.close()


def turn_stats(screen: str) -> tuple[int, int, int, int]:
    """(prompt tokens, cached, computed, generated) from a turn's --verbose line."""
    (match,) = STATS.findall(screen)
    return tuple(int(x) for x in match)


def reply(screen: str, typed: str) -> str:
    """The streamed reply: the line after the echo of what was typed."""
    return screen.split(typed + "\n", 1)[1].split("\n", 1)[0]


def test_two_turns_stats_and_reset(chat):
    term = chat("-m", "30", "--ignore-eos", "--system-prompt", "w9", "--verbose")
    assert "/reset" in term.read_until(b">> ")  # the banner names the commands
    first = term.say("w10 w11")
    prompt1, cached1, computed1, generated1 = turn_stats(first)
    assert (prompt1, generated1) == (6, 30)  # w1 w9 (system) w2 w10 w11 w3 (user, then the assistant's turn)
    assert computed1 == prompt1 - cached1
    text1 = reply(first, "w10 w11")
    assert len(text1.split()) == 30 and all(w.startswith("w") for w in text1.split())

    second = term.say("w12")
    prompt2, cached2, computed2, generated2 = turn_stats(second)
    # The whole conversation: turn 1's prompt, its reply (30 tokens), then w2 w12 w3.
    assert prompt2 == prompt1 + generated1 + 3
    assert computed2 == prompt2 - cached2
    # The engine's prefix cache kept turn 1's KV (its prompt and reply, but the reply's last token,
    # never fed) in blocks of 16 tokens: turn 2 computes its new tokens and the last partial block.
    assert cached2 == 16 * ((prompt1 + generated1 - 1) // 16) == 32
    assert computed2 <= 3 + 16

    assert turn_stats(term.say("/stats")) == (prompt2, cached2, computed2, generated2)
    assert "forgotten" in term.say("/reset")
    again = term.say("w10 w11")
    assert turn_stats(again)[0] == prompt1  # the system prompt stays, the turns are gone
    assert reply(again, "w10 w11") == text1  # greedy: the same conversation, the same reply
    assert "unknown command /nope" in term.say("/nope")
    os.write(term.master, b"\x04")  # Ctrl-D
    assert term.proc.wait(timeout=30) == 0


def test_chat_needs_a_template(tmp_path):
    folder = mlxfun.save(tiny_model(seed=3), tmp_path / "plain")
    run = subprocess.run([sys.executable, "-m", "mlxfun", "chat", "--model", str(folder)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "has no chat template" in run.stderr and "Traceback" not in run.stderr
