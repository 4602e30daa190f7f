"""Rebuild a `tokenizers` tokenizer from the vocabulary a GGUF file stores in its metadata.

A GGUF has no tokenizer.json: it stores tokens, merges, token types and special ids under llama.cpp's
``tokenizer.ggml.*`` keys. Two vocabularies are rebuilt here, the ones llama-architecture files use:
``gpt2`` (byte-level BPE: SmolLM, Llama 3) and ``llama`` (sentencepiece-style BPE with byte fallback:
Llama 2, Mistral). The pieces chosen match what transformers builds from the same file, so both
tokenize identically.
"""

from __future__ import annotations

import logging
from functools import lru_cache

from ..errors import UnsupportedError

logger = logging.getLogger("cudaformers")

# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer regexes for byte-level vocabularies whose merges were learnt on another split than
# GPT-2's, by the `tokenizer.ggml.pre` name llama.cpp gives them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")}
_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")})


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    others are shifted to 256 and up so that no byte maps to whitespace or a control character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _merges(meta: dict, vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    # sentencepiece files carry scores instead: every split of a token into two known tokens is a merge,
    # ranked by the merged token's score (best first), ties by the pieces' lengths then ids.
    logger.info("GGUF file has no merges; deriving them from the vocabulary scores")
    merges = []
    for token, score in (scores or vocab).items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=scores is not None)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_alphabet()
    chars = set(alphabet.values())
    vocab = {}
    for i, token in enumerate(meta["tokenizer.ggml.tokens"]):
        # Tokens outside the byte alphabet (a few files store added tokens as raw text) are respelled.
        vocab[token if set(token) <= chars else "".join(alphabet[b] for b in token.encode())] = i
    backend = Tokenizer(models.BPE(vocab, _merges(meta, vocab, None), fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, chars


def _sentencepiece(meta: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    scores = dict(zip(tokens, meta["tokenizer.ggml.scores"])) if "tokenizer.ggml.scores" in meta else None
    backend = Tokenizer(models.BPE(vocab, _merges(meta, vocab, scores), fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend, None


def build_gguf_tokenizer(meta: dict, path: str = "<gguf>"):
    """A ``cudaformers.tokenizer.Tokenizer`` from a GGUF file's metadata dict."""
    from tokenizers import AddedToken

    from ..tokenizer import Tokenizer

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise UnsupportedError(f"{path} stores no vocabulary (tokenizer.ggml.tokens); load the tokenizer from "
                               "the original model folder: AutoTokenizer.from_pretrained('<folder or repo id>')")
    if kind == "gpt2":
        backend, alphabet = _byte_level(meta)
    elif kind == "llama":
        backend, alphabet = _sentencepiece(meta)
    else:
        raise UnsupportedError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', "
                               "'llama'); load the tokenizer from the original model folder instead")

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    # Control tokens (<|im_start|>, <s>) are special; user-defined ones (<think>) are plain added tokens.
    # Both must be matched whole in text. A byte-level "control" token spelled outside the byte
    # alphabet is a converter mislabel and would grow the vocabulary, so it stays a normal token.
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = backend.get_vocab()
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    config: dict = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[int(token_id)] if token_id is not None else None
    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return Tokenizer(backend, config, name_or_path=path)
