"""The real-model prompts of the batched == alone checks: one token to ~110, chat and raw, several scripts."""

from __future__ import annotations

import os

from mlxfun.generate import generate

# Real-model tests generate this many tokens (the CPU here costs ~0.1-0.2 s per row and token, and
# the suite must stay well under 15 minutes on 2 cores); MLXFUN_REAL_TOKENS=64 runs the full-length check.
REAL_TOKENS = int(os.environ.get("MLXFUN_REAL_TOKENS", "12"))

LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. Its legions built roads, aqueducts and fortifications across Europe, North Africa and "
        "the Middle East, and its law, language and institutions shaped the societies that followed. ") * 2

REAL_PROMPTS = [
    {"text": "Hi"},  # one token
    {"text": "The capital of France is"},
    {"text": "What is the boiling point of water?", "chat": True},
    {"text": "def fibonacci(n):\n    "},
    {"text": "東京は日本の首都です。人口は"},
    {"text": "Écris une phrase sur la mer."},
    {"text": "List three colors.", "chat": True},
    {"text": "1, 2, 3, 4, 5,"},
    {"text": "Привет! Как дела?"},
    {"text": "import numpy as np\nx = np.arange(10)\nprint("},
    {"text": "Summarize: " + LONG[:200], "chat": True},
    {"text": LONG},  # about 110 tokens
]


def ids(model, p):
    if p.get("chat"):
        return model.tokenizer.encode_chat([{"role": "user", "content": p["text"]}])
    return model.tokenizer.encode(p["text"])


def alone(model, which: list[dict] | None = None):
    """(prompt ids, each prompt's output alone) for `which` (default: REAL_PROMPTS)."""
    prompts = [ids(model, p) for p in (REAL_PROMPTS if which is None else which)]
    return prompts, [generate(model, [p], max_tokens=REAL_TOKENS).token_ids[0] for p in prompts]
