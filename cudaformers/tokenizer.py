"""Tokenizer with the transformers API, backed by the `tokenizers` library.

``AutoTokenizer.from_pretrained(folder_or_repo_id)`` reads tokenizer.json and tokenizer_config.json
(plus special_tokens_map.json and chat templates); ``gguf_file=`` rebuilds the tokenizer from a GGUF
file's metadata. Chat templates render in jinja2's immutable sandbox: they come from the checkpoint
and run no code of ours. ``DetokenizeStream`` turns generated ids into text as they arrive.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .chat_template import compile_template
from .detokenize import DetokenizeStream, as_list  # noqa: F401  (DetokenizeStream is public here too)
from .errors import CheckpointError, UnsupportedError

logger = logging.getLogger("cudaformers")

VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class BatchEncoding(dict):
    """The tokenizer's output: a dict with attribute access (``enc.input_ids``) and ``.to(device)``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device) -> "BatchEncoding":
        for key, value in self.items():
            if hasattr(value, "to"):
                self[key] = value.to(device)
        return self


def _token_str(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return None if value is None else str(value)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens, padding and chat template of its config."""

    def __init__(self, backend, config: dict | None = None, *, name_or_path: str = ""):
        from tokenizers import AddedToken

        config = dict(config or {})
        self._backend = backend
        self._config = config
        self.name_or_path = name_or_path
        self._special = {name: _token_str(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):  # named model-specific tokens (image_token, ...) count as named ones
            self._special.update({name: _token_str(v) for name, v in extra.items()})
            extra = []
        self._extra = [_token_str(t) for t in extra]
        self.padding_side = config.get("padding_side", "right")
        self.truncation_side = config.get("truncation_side", "right")
        self.model_max_length = int(config.get("model_max_length") or VERY_LARGE_INTEGER)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = config.get("chat_template")

        # Padding/truncation saved in tokenizer.json become defaults; each call then applies its own.
        if backend.padding:
            self._special["pad_token"] = self._special["pad_token"] or backend.padding["pad_token"]
            self.padding_side = config.get("padding_side", backend.padding["direction"])
            backend.no_padding()
        if backend.truncation:
            self.truncation_side = config.get("truncation_side", backend.truncation["direction"])
            backend.no_truncation()

        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(**{k: v for k, v in t.items() if k != "__type"})
                   for _, t in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0]))
                   if t["content"] not in present]
        if missing:
            backend.add_tokens(missing)
        named = [t for t in (*self._special.values(), *self._extra) if t is not None and t not in present]
        if named:
            backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named)])

        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        # As transformers does: an explicit add_bos/eos_token (or no post-processor) rebuilds the template.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            self._rebuild_post_processor()

    def _rebuild_post_processor(self):
        from tokenizers import processors

        bos = self.bos_token if self.add_bos_token else None
        eos = self.eos_token if self.add_eos_token else None
        single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
        pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
        specials = [(t, self.convert_tokens_to_ids(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # -- loading and saving ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo_id, *, gguf_file: str | None = None, **kwargs) -> "Tokenizer":
        from .hub import resolve_folder

        hub_keys = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        folder = resolve_folder(path_or_repo_id, gguf_file=gguf_file, weights=bool(gguf_file), **hub_keys)
        if gguf_file:
            from .loading.gguf import gguf_tokenizer

            tok = gguf_tokenizer(folder / gguf_file)
        else:
            tok = cls._from_folder(folder)
        for key, value in kwargs.items():  # e.g. padding_side="left", model_max_length=...
            if key not in ("padding_side", "truncation_side", "model_max_length", "chat_template",
                           *SPECIAL_TOKEN_NAMES):
                raise UnsupportedError(f"AutoTokenizer.from_pretrained got an unsupported argument {key!r}")
            setattr(tok, key, value)
        return tok

    @classmethod
    def _from_folder(cls, folder: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        file = folder / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json; cudaformers reads fast-tokenizer files only "
                                  "(convert once with transformers: AutoTokenizer.from_pretrained(folder)"
                                  ".save_pretrained(folder))")
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
            if (folder / name).is_file():
                try:
                    config.update(json.loads((folder / name).read_text(encoding="utf-8")))
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{folder / name} is not valid JSON ({e}); re-download or fix it") from e
        templates = {}
        if isinstance(config.get("chat_template"), list):
            templates = {t["name"]: t["template"] for t in config["chat_template"]}
        elif config.get("chat_template"):
            templates["default"] = config["chat_template"]
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        for file_ in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[file_.stem] = file_.read_text(encoding="utf-8")
        config["chat_template"] = (templates.get("default") if set(templates) <= {"default"} else templates) or None
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise CheckpointError(f"{file} could not be read ({e}); re-download it") from e
        return cls(backend, config, name_or_path=str(folder))

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        config = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend",
                  "padding_side": self.padding_side, "truncation_side": self.truncation_side,
                  "model_max_length": self.model_max_length,
                  "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces}
        config.update({name: tok for name, tok in self._special.items() if tok is not None})
        if self._extra:
            config["extra_special_tokens"] = list(self._extra)
        for key in ("add_bos_token", "add_eos_token"):
            if key in self._config:
                config[key] = getattr(self, key)
        if isinstance(self.chat_template, str):
            (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        elif self.chat_template:
            config["chat_template"] = [{"name": n, "template": t} for n, t in self.chat_template.items()]
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")

    # -- vocabulary and special tokens ----------------------------------------------------------------
    @property
    def backend_tokenizer(self):
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (as in transformers)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        return self._backend.get_added_tokens_decoder()

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: tok for name, tok in self._special.items() if tok is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return self.unk_token_id if index is None and tokens != self.unk_token else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0:
            return self._backend.id_to_token(int(ids))
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in as_list(ids) if int(i) not in skip]

    def add_tokens(self, tokens: str | list[str], special_tokens: bool = False) -> int:
        from tokenizers import AddedToken

        tokens = [tokens] if isinstance(tokens, str) else tokens
        added = [t if isinstance(t, AddedToken) else
                 AddedToken(t, special=special_tokens, normalized=not special_tokens) for t in tokens]
        return self._backend.add_special_tokens(added) if special_tokens else self._backend.add_tokens(added)

    def add_special_tokens(self, tokens: dict) -> int:
        """``{"pad_token": "<pad>", "extra_special_tokens": [...]}``: set and add special tokens."""
        count = 0
        for name, value in tokens.items():
            if name in ("extra_special_tokens", "additional_special_tokens"):
                values = [_token_str(v) for v in value]
                self._extra = list(dict.fromkeys([*self._extra, *values]))
            else:
                values = [_token_str(value)]
                self._special[name] = values[0]
            count += self.add_tokens(values, special_tokens=True)
        return count

    # -- encoding -------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def encode(self, text: str, add_special_tokens: bool = True, *, truncation: bool | None = None,
               max_length: int | None = None, return_tensors: str | None = None):
        out = self(text, add_special_tokens=add_special_tokens, truncation=truncation, max_length=max_length,
                   return_tensors=return_tensors)
        return out["input_ids"]

    def __call__(self, text: str | list[str], *, add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool | str | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None, return_attention_mask: bool = True) -> BatchEncoding:
        batched = not isinstance(text, str)
        texts = list(text) if batched else [text]
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings")
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers' rule: a max_length alone asks for truncation
        if truncation not in (None, False, True, "longest_first", "only_first", "do_not_truncate"):
            raise UnsupportedError(f"truncation={truncation!r} is not supported; use True or False")
        truncate = truncation not in (None, False, "do_not_truncate")
        if padding not in (False, True, "longest", "max_length", "do_not_pad"):
            raise UnsupportedError(f"padding={padding!r} is not supported; use True, 'longest' or 'max_length'")
        pad_to = None if padding in (False, "do_not_pad") else padding
        if max_length is None:
            limit = self.model_max_length if self.model_max_length < VERY_LARGE_INTEGER else None
            max_length = limit if (truncate or pad_to == "max_length") else None
            truncate = truncate and limit is not None
            pad_to = "longest" if pad_to == "max_length" and limit is None else pad_to

        ids = self._encode_ids(texts, add_special_tokens, max_length if truncate else None)
        masks = [[1] * len(x) for x in ids]
        if pad_to is not None:
            ids, masks = self._pad(ids, masks, max_length if pad_to == "max_length" else None, pad_to_multiple_of,
                                   padding_side or self.padding_side)
        out = BatchEncoding(input_ids=ids)
        if return_attention_mask:
            out["attention_mask"] = masks
        if return_tensors is not None:
            return _to_tensors(out, return_tensors)
        if not batched:
            for key in out:
                out[key] = out[key][0]
        return out

    def _encode_ids(self, texts: list[str], add_special_tokens: bool, max_length: int | None) -> list[list[int]]:
        if max_length is None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        room = max_length - (self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0)
        if room < 0:
            raise ValueError(f"max_length={max_length} leaves no room next to the special tokens this tokenizer adds")
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        out = []
        for enc in encodings:
            enc.truncate(room, direction=self.truncation_side)
            out.append(self._backend.post_process(enc, add_special_tokens=add_special_tokens).ids)
        return out

    def _pad(self, ids, masks, length, multiple, side):
        if self.pad_token_id is None:
            raise ValueError("padding needs a pad token and this tokenizer has none; set one, e.g. "
                             "tokenizer.pad_token = tokenizer.eos_token")
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {side!r}")
        target = length if length is not None else max(map(len, ids), default=0)
        if multiple:
            target = -(-target // multiple) * multiple
        pad = self.pad_token_id
        new_ids, new_masks = [], []
        for seq, mask in zip(ids, masks):
            n = max(0, target - len(seq))
            if side == "left":
                new_ids.append([pad] * n + seq)
                new_masks.append([0] * n + mask)
            else:
                new_ids.append(seq + [pad] * n)
                new_masks.append(mask + [0] * n)
        return new_ids, new_masks

    # -- decoding -------------------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **_) -> str:
        ids = [int(token_ids)] if isinstance(token_ids, int) or getattr(token_ids, "ndim", 1) == 0 \
            else [int(i) for i in as_list(token_ids)]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # The clean-up was made for WordPiece; on BPE it deletes real spaces, so transformers skips it there.
        if clean and type(self._backend.model).__name__ != "BPE":
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        return [self.decode(seq, skip_special_tokens=skip_special_tokens, **kwargs) for seq in as_list(sequences)]

    # -- chat templates -------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in templates else "default"
                if name not in templates:
                    raise UnsupportedError(f"this tokenizer has chat templates {sorted(templates)} and none is "
                                           "'default'; pick one: apply_chat_template(..., chat_template='<name>')")
                return templates[name]
        if chat_template is not None:
            return chat_template
        if not templates:
            raise UnsupportedError(f"tokenizer {self.name_or_path!r} has no chat template; pass one with "
                                   "apply_chat_template(..., chat_template='{% for m in messages %}...') or set "
                                   "tokenizer.chat_template (base models have none: use plain text prompts)")
        return templates

    def apply_chat_template(self, messages, tools=None, documents=None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, padding: bool | str = False, truncation: bool = False,
                            max_length: int | None = None, return_tensors: str | None = None,
                            return_dict: bool = False, **template_kwargs):
        """Render ``messages`` (or a batch of conversations) with the chat template.

        Returns the text (``tokenize=False``), the token ids, or a BatchEncoding (``return_dict=True``).
        """
        template = self.get_chat_template(chat_template, tools)
        batched = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if batched else [messages]
        if any(not conv for conv in conversations):
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        compiled = compile_template(template)
        context = {**self.special_tokens_map, **template_kwargs}
        rendered = []
        for conv in conversations:
            conv = [{k: v for k, v in dict(m).items() if v is not None} for m in conv]
            text = compiled.render(messages=conv, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **context)
            if continue_final_message:
                final = conv[-1]["content"].strip()
                cut = text.rfind(final)
                if cut < 0:
                    raise ValueError("continue_final_message: the chat template does not render the final "
                                     "message verbatim, so it cannot be continued")
                text = text[:cut + len(final)]
            rendered.append(text)
        if not tokenize:
            return rendered if batched else rendered[0]
        out = self(rendered if batched else rendered[0], add_special_tokens=False, padding=padding,
                   truncation=truncation, max_length=max_length, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab={len(self)}, "
                f"special={self.special_tokens_map}, padding_side={self.padding_side!r})")


def _special_property(name: str):
    def get_token(self):
        return self._special.get(name)

    def set_token(self, value):
        self._special[name] = _token_str(value)
        if value is not None and self._backend.token_to_id(self._special[name]) is None:
            self.add_tokens([self._special[name]], special_tokens=True)

    def get_id(self):
        token = self._special.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def set_id(self, value):
        set_token(self, None if value is None else self._backend.id_to_token(int(value)))

    return property(get_token, set_token), property(get_id, set_id)


for _name in SPECIAL_TOKEN_NAMES:
    _tok_prop, _id_prop = _special_property(_name)
    setattr(Tokenizer, _name, _tok_prop)
    setattr(Tokenizer, f"{_name}_id", _id_prop)


def _to_tensors(out: BatchEncoding, kind: str) -> BatchEncoding:
    lengths = {len(x) for x in out["input_ids"]}
    if len(lengths) > 1:
        raise ValueError("the sequences have different lengths and cannot form one tensor; pass padding=True")
    if kind == "pt":
        import torch

        return BatchEncoding({k: torch.tensor(v, dtype=torch.long).reshape(len(v), -1) for k, v in out.items()})
    if kind == "np":
        import numpy as np

        return BatchEncoding({k: np.asarray(v, dtype=np.int64).reshape(len(v), -1) for k, v in out.items()})
    raise UnsupportedError(f"return_tensors={kind!r} is not supported; use 'pt', 'np' or None")


class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(folder_or_repo_id, gguf_file=None, padding_side=...)``."""

    @staticmethod
    def from_pretrained(path_or_repo_id, **kwargs) -> Tokenizer:
        return Tokenizer.from_pretrained(path_or_repo_id, **kwargs)
