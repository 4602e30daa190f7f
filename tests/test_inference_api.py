"""pipeline(), streamers and the generate/chat commands, on the embedded SmolLM2 and tiny models."""

import subprocess
import sys
import threading

import pytest
import torch

from cudaformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer, pipeline
from cudaformers.embedded import default_model


@pytest.fixture(scope="module")
def smol():
    folder, gguf = default_model()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    return model, tok


def test_pipeline_with_text_and_chat(smol):
    model, tok = smol
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    out = pipe("The capital of France is", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("The capital of France is")
    assert "Paris" in out[0]["generated_text"]
    chat = pipe([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12, do_sample=False)
    answer = chat[0]["generated_text"][-1]
    assert answer["role"] == "assistant" and "Paris" in answer["content"]


def test_iterator_streamer_yields_the_same_text_as_decode(smol):
    model, tok = smol
    enc = tok("Once upon a time", return_tensors="pt")
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=model.generate(enc["input_ids"], max_new_tokens=16, do_sample=False, streamer=streamer)))
    worker.start()
    pieces = list(streamer)
    worker.join()
    assert len(pieces) > 1
    assert "".join(pieces) == tok.decode(result["out"][0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_stop_strings_end_generation(smol):
    model, tok = smol
    enc = tok("1, 2, 3, 4,", return_tensors="pt")
    out = model.generate(enc["input_ids"], max_new_tokens=30, do_sample=False, stop_strings=["7"], tokenizer=tok)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:])
    assert text.rstrip().endswith("7"), text


def test_pipeline_rejects_unknown_task():
    with pytest.raises(ValueError, match="text-generation"):
        pipeline("summarization", model="x")


def test_cli_generate_default_model():
    out = subprocess.run([sys.executable, "-m", "cudaformers.cli", "generate", "--greedy", "--max-new-tokens", "8",
                          "The capital of France is"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is") and "Paris" in out.stdout


def test_cli_chat_once():
    out = subprocess.run([sys.executable, "-m", "cudaformers.cli", "chat", "--greedy", "--max-new-tokens", "20",
                          "--once", "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_unknown_model_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cudaformers.cli", "generate", str(tmp_path / "nope"), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "neither a local folder nor" in out.stderr
