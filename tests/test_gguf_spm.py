"""SentencePiece tokenizers in GGUF files (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Gemma, Phi-3)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from helpers import tiny_config, tiny_params
from test_gguf import write_gguf

import mlxfun
from mlxfun.engine.detok import RowText
from mlxfun.model.tokenizer import from_gguf

S = "\u2581"  # SentencePiece's space
CONTROL = ["<s>", "</s>", "<start_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Normal pieces with their scores: "th" merges first, then "he", "▁t", "the", "▁the".
NORMAL = {S: -1.0, "t": -2.0, "h": -3.0, "e": -4.0, "a": -5.0, "th": -6.0, "he": -7.0, f"{S}t": -8.0,
          "the": -9.0, f"{S}the": -10.0, f"{S}{S}": -11.0, "ea": -12.0}
TOKENS = ["<unk>", *CONTROL, *BYTES, *NORMAL]
TYPES = [2, 3, 3, 3] + [6] * 256 + [1] * len(NORMAL)
SCORES = [0.0] * (4 + 256) + list(NORMAL.values())
ID = {t: i for i, t in enumerate(TOKENS)}


def spm_meta(**overrides) -> dict:
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": mx.array(SCORES, dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(TYPES, dtype=mx.int32),
        "tokenizer.ggml.merges": None,
        "tokenizer.ggml.pre": None,
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": "{% for m in messages %}<start_of_turn>{{ m['content'] }}</s>{% endfor %}",
    }
    return {**meta, **overrides}


def load_tokenizer(tmp_path, name="spm.gguf", **overrides):
    """The tokenizer of a GGUF file written with `spm_meta(**overrides)` and read back as mlxfun does."""
    path = tmp_path / name
    mx.save_gguf(str(path), {"x": mx.zeros(4)}, {k: v for k, v in spm_meta(**overrides).items() if v is not None})
    _, metadata = mx.load(str(path), return_metadata=True)
    return from_gguf(metadata)


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def spm_bpe(text: str) -> list[int]:
    """SentencePiece's BPE as llama.cpp runs it: characters (bytes when out of vocabulary), then
    repeatedly join the adjacent pair whose union scores highest (leftmost on ties)."""
    symbols = list(text)
    while True:
        pairs = [(NORMAL[a + b], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in NORMAL]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i: i + 2] = [symbols[i] + symbols[i + 1]]
    return [i for s in symbols for i in ([ID[s]] if s in ID else ids(*(BYTES[b] for b in s.encode())))]


def test_spm_gguf_words_with_and_without_space_prefix(tmp_path):
    tok = load_tokenizer(tmp_path)  # Llama/Mistral: a space prefixed to the text
    assert tok.encode("the") == ids(f"{S}the")
    assert tok.encode(" the") == ids(S, f"{S}the")
    assert tok.encode("the the") == ids(f"{S}the", f"{S}the")
    assert tok.encode("tthe") == ids(f"{S}t", "the")
    gemma = load_tokenizer(tmp_path, "gemma.gguf", **{"tokenizer.ggml.add_space_prefix": mx.array(False)})
    assert gemma.encode("the") == ids("the")
    assert gemma.encode(" the") == ids(f"{S}the")
    assert gemma.encode("heathe") == ids("he", "a", "the")  # "th", then "he", then "the"


def test_spm_gguf_unknown_characters_fall_back_to_bytes(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert tok.encode("é") == ids(S, "<0xC3>", "<0xA9>")
    assert tok.encode("the\n") == ids(f"{S}the", "<0x0A>")
    assert tok.encode("xé") == ids(S, "<0x78>", "<0xC3>", "<0xA9>")
    gemma = load_tokenizer(tmp_path, "gemma.gguf", **{"tokenizer.ggml.add_space_prefix": mx.array(False)})
    assert gemma.encode("é") == ids("<0xC3>", "<0xA9>")
    assert gemma.decode(ids("<0xC3>", "<0xA9>")) == "é"


def test_spm_gguf_control_tokens_encode_whole(tmp_path):
    """Control tokens are one id each; as in llama.cpp, the text after one gets the space prefix too."""
    tok = load_tokenizer(tmp_path)
    assert tok.encode("<start_of_turn>the</s>") == ids("<start_of_turn>", f"{S}the", "</s>")
    assert tok.eos_token_ids == {ID["</s>"]} and tok.bos_token_id == ID["<s>"]
    assert tok.encode_chat([{"role": "user", "content": "the"}]) == ids("<start_of_turn>", f"{S}the", "</s>")
    assert tok.decode(ids("<start_of_turn>", f"{S}the"), skip_special_tokens=True) == "the"
    gemma = load_tokenizer(tmp_path, "gemma.gguf", **{"tokenizer.ggml.add_space_prefix": mx.array(False)})
    assert gemma.encode("<start_of_turn>the") == ids("<start_of_turn>", "the")


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("text", ["the", " the", "  the  the ", "the\nthe\n\n", "\n the", "é the\tthé", ""])
def test_spm_gguf_decode_inverts_encode(tmp_path, prefix, text):
    tok = load_tokenizer(tmp_path, **{"tokenizer.ggml.add_space_prefix": mx.array(prefix),
                                      "tokenizer.ggml.add_bos_token": mx.array(True)})
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


@pytest.mark.parametrize("prefix", [True, False])
def test_spm_gguf_streamed_text_equals_decode(tmp_path, prefix):
    """Token by token (bytes of one character split over tokens), the text is the whole decode's."""
    tok = load_tokenizer(tmp_path, **{"tokenizer.ggml.add_space_prefix": mx.array(prefix)})
    generated = ids(f"{S}the", f"{S}the", "<0xC3>", "<0xA9>", "<0x0A>", S, "the")
    row = RowText(tok, ())
    streamed = "".join(row.add(t) for t in generated) + row.flush()
    assert streamed == tok.decode(generated) == ("" if prefix else " ") + "the theé\n the"


def test_spm_gguf_adds_bos_when_asked(tmp_path):
    assert load_tokenizer(tmp_path, "plain.gguf").encode("the") == ids(f"{S}the")
    tok = load_tokenizer(tmp_path, "bos.gguf", **{"tokenizer.ggml.add_bos_token": mx.array(True)})
    assert tok.add_bos and tok.encode("the") == ids("<s>", f"{S}the")
    assert tok.encode("the", add_special_tokens=False) == ids(f"{S}the")
    assert tok.encode("<s>the") == ids("<s>", f"{S}the")  # not doubled
    assert tok.encode_chat([{"role": "user", "content": "the"}])[0] == ID["<start_of_turn>"]


def test_spm_gguf_matches_sentencepiece_merging(tmp_path):
    """The derived BPE merges pick the same pieces as SentencePiece's highest-score-first merging."""
    tok = load_tokenizer(tmp_path, **{"tokenizer.ggml.add_space_prefix": mx.array(False)})
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("theaé x ") for _ in range(rng.randint(1, 12)))
        assert tok.encode(text) == spm_bpe(text.replace(" ", S)), text


def test_phi3_spm_markers_eat_the_whitespace_after_them(tmp_path):
    """Phi-3's tokenizer.json (and llama.cpp, by model name) right-strip its chat markers."""
    tok = load_tokenizer(tmp_path, **{"general.architecture": "phi3"})
    assert tok.encode("<start_of_turn>\n the") == ids("<start_of_turn>", f"{S}the")
    assert tok.encode("<s> the") == ids("<s>", S, f"{S}the")


def test_spm_gguf_loads_with_a_model(tmp_path):
    config = tiny_config(vocab_size=len(TOKENS))
    _, w = tiny_params(config)
    meta = {k: v for k, v in spm_meta().items() if k != "general.architecture"}
    model = mlxfun.load(write_gguf(tmp_path / "tiny.gguf", config, w, **meta))
    assert model.tokenizer.encode("<start_of_turn>the é") == ids("<start_of_turn>", f"{S}the", S, "<0xC3>", "<0xA9>")


def test_spm_gguf_without_scores(tmp_path):
    with pytest.raises(mlxfun.ModelError, match="tokenizer.ggml.scores"):
        load_tokenizer(tmp_path, **{"tokenizer.ggml.scores": None})
