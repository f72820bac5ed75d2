"""Tokenizers from `tokenizer.json` or from GGUF metadata, with the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from mlxfun.chat_template import render as render_template
from mlxfun.errors import InputError, ModelError

# Tokens that end a turn or a text in the common chat formats; added to the EOS set when present.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>")

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space in its pieces

# llama.cpp's `tokenizer.ggml.pre` names -> the split applied before the byte-level mapping.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(name: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("gpt2", "default"):
        return byte_level
    if name == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if name in splits:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(splits[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ModelError(f"unsupported GGUF pre-tokenizer {name!r} (supported: smollm, gpt2, llama-bpe, qwen2)")


class Tokenizer:
    """Text <-> token ids, plus EOS ids and the chat template."""

    def __init__(self, backend: HFTokenizer, *, eos_token_ids: set[int], bos_token_id: int | None,
                 add_bos: bool, chat_template: str | None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        for text in END_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None:
                eos_token_ids = eos_token_ids | {tid}
        self.eos_token_ids = frozenset(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, tid: int) -> str:
        return self.backend.id_to_token(tid)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]) and `tools` (OpenAI's
        [{"type": "function", "function": {...}}], given to the template as Hugging Face's are)."""
        if not self.chat_template:
            raise InputError("this model has no chat template; pass chat=False")
        bos = self.token(self.bos_token_id) if self.bos_token_id is not None else ""
        return render_template(self.chat_template, messages, tools=tools,
                               add_generation_prompt=add_generation_prompt, bos_token=bos)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template writes any BOS itself.
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


def _spm_merges(tokens: list[str], scores: list[float], ids: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE: every split of a piece into two pieces of the
    vocabulary, in order of the whole piece's score (highest first), as Transformers derives them.
    SentencePiece merges the adjacent pair whose union scores highest; BPE applies the lowest rank.
    `ids`: each piece's id."""
    merges = []
    for i in sorted(range(len(tokens)), key=lambda i: -scores[i]):  # stable: ties keep id order
        piece = tokens[i]
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        merges += sorted(((a, b) for a, b in splits if a in ids and b in ids), key=lambda m: (ids[m[0]], ids[m[1]]))
    return merges


def _bpe_backend(metadata: dict, tokens: list[str]) -> HFTokenizer:
    """Byte-level BPE (`gpt2`): merges from the file, a pre-tokenizer named by `tokenizer.ggml.pre`."""
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelError("GGUF metadata lacks 'tokenizer.ggml.merges': the file carries no usable tokenizer")
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_backend(metadata: dict, tokens: list[str], unk: int | None) -> HFTokenizer:
    """SentencePiece BPE (`llama`): merges derived from the scores, "▁" for spaces, <0xNN> pieces
    for characters outside the vocabulary (Transformers' GGUFLlamaConverter, llama.cpp's SPM)."""
    if "tokenizer.ggml.scores" not in metadata:
        raise ModelError("GGUF metadata lacks 'tokenizer.ggml.scores': the file carries no usable tokenizer")
    scores = [float(s) for s in metadata["tokenizer.ggml.scores"].tolist()]
    if len(scores) != len(tokens):
        raise ModelError(f"GGUF metadata has {len(tokens)} tokens but {len(scores)} scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, vocab),
                                     unk_token=None if unk is None else tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
    # llama.cpp prefixes a space to the text and to each piece of text after a special token;
    # the normalizer runs on each such piece. Gemma's files turn the prefix off.
    prefix = metadata.get("tokenizer.ggml.add_space_prefix")
    prefix = True if prefix is None else bool(prefix.item())
    replace = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return backend


def from_gguf(metadata: dict) -> Tokenizer:
    """Rebuild the tokenizer stored in GGUF metadata: byte-level BPE (`gpt2`) or SentencePiece (`llama`)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelError(f"unsupported GGUF tokenizer model {kind!r} (supported: byte-level BPE 'gpt2', "
                         "SentencePiece 'llama')")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        if key not in metadata:
            raise ModelError(f"GGUF metadata lacks {key!r}: the file carries no usable tokenizer")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"].tolist()]
    if len(types) != len(tokens):
        raise ModelError(f"GGUF metadata has {len(tokens)} tokens but {len(types)} token types")

    def meta_int(key):
        v = metadata.get(key)
        return None if v is None else int(v.item() if hasattr(v, "item") else v)

    if kind == "gpt2":
        backend = _bpe_backend(metadata, tokens)
    else:
        backend = _spm_backend(metadata, tokens, meta_int("tokenizer.ggml.unknown_token_id"))
    # Types 3 (control) and 4 (user-defined) are matched whole, before any other splitting.
    # Phi-3's markers eat the whitespace after them, as its tokenizer.json and llama.cpp do.
    phi3 = kind == "llama" and metadata.get("general.architecture") == "phi3"
    unstripped = {"<unk>", "<s>", "<|endoftext|>"}
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False,
                                           rstrip=phi3 and tokens[i] not in unstripped)
                                for i, t in enumerate(types) if t == 3])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == 4])

    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    eos = meta_int("tokenizer.ggml.eos_token_id")
    return Tokenizer(backend, eos_token_ids=set() if eos is None else {eos},
                     bos_token_id=meta_int("tokenizer.ggml.bos_token_id"),
                     add_bos=bool(add_bos.item()) if add_bos is not None else False,
                     chat_template=metadata.get("tokenizer.chat_template"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def from_folder(folder: Path, config: dict) -> Tokenizer:
    """The tokenizer of a Hugging Face folder: tokenizer.json plus its config files."""
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelError(f"{folder} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    tk_config = _read_json(folder / "tokenizer_config.json")
    gen_config = _read_json(folder / "generation_config.json")

    def token_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos = set()
    for source in (config.get("eos_token_id"), gen_config.get("eos_token_id")):
        if source is not None:
            eos |= set(source if isinstance(source, list) else [source])
    if (tid := token_id(tk_config.get("eos_token"))) is not None:
        eos.add(tid)
    template = tk_config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, eos_token_ids=eos, bos_token_id=token_id(tk_config.get("bos_token")),
                     add_bos=False, chat_template=template)


def save_folder(tokenizer: Tokenizer, folder: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    backend = tokenizer.backend
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        from tokenizers import processors

        bos = tokenizer.token(tokenizer.bos_token_id)
        backend = HFTokenizer.from_str(backend.to_str())
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    backend.save(str(folder / "tokenizer.json"))
    # The class that reads tokenizer.json as it is (Transformers would otherwise pick the model
    # family's own class, which may expect tokens this tokenizer lacks: Gemma's <unk>).
    tk_config = {"chat_template": tokenizer.chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}
    if tokenizer.bos_token_id is not None:
        tk_config["bos_token"] = tokenizer.token(tokenizer.bos_token_id)
    (folder / "tokenizer_config.json").write_text(json.dumps(tk_config, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": sorted(tokenizer.eos_token_ids)}, indent=2))
