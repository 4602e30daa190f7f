"""transformers' tokenizer for a GGUF file, as the test oracle, with the special tokens and BOS rule
the file declares. transformers 5.17 reads the SmolLM2 file's eos as <|im_start|>, drops its
padding_token_id and ignores add_bos_token (5.24 follows the file); the file's metadata is the
authority."""

from __future__ import annotations


def _reader(path):
    import gguf

    return gguf.GGUFReader(str(path))


def declared_special_ids(path) -> dict[str, int]:
    reader = _reader(path)
    out = {}
    for name in ("bos", "eos", "unknown", "padding"):
        field = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is not None:
            out[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = int(field.parts[-1][0])
    return out


def hf_gguf_tokenizer(folder, name):
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    for attr, token_id in declared_special_ids(Path(folder) / name).items():
        if getattr(tok, f"{attr}_id") != token_id:
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    add_bos = _reader(Path(folder) / name).fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and bool(add_bos.parts[-1][0]) != bool(getattr(tok, "add_bos_token", False)):
        tok.add_bos_token = bool(add_bos.parts[-1][0])
    return tok
