"""Streamed loading on a GPU: a ~1 GB sharded checkpoint loads bit-for-bit as the tensor-by-tensor
path does (in its dtype, converted, quantized on load), the stream equals safetensors' reader on every
dtype, staging memory stays bounded, and a failing load stops its readers."""

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

import tiny
from cudaformers import AutoModelForCausalLM, Int8Config
from cudaformers.errors import CheckpointError
from cudaformers.loading import streaming
from cudaformers.loading.streaming import stream_safetensors
from tests.test_loading_streaming import SIZES, _bytes, _checkpoint, _gptq_folder, _write_raw

pytestmark = pytest.mark.gpu
SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
             max_position_embeddings=4096)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """~1.06 GB of seeded random bf16 weights in three shards, saved by transformers."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen3-1b")
    config = transformers.Qwen3Config(**SHAPE, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, max_shard_size="400MB")
    del model
    torch.cuda.empty_cache()
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


def _load(folder, streamed: bool, monkeypatch, **kw):
    monkeypatch.setenv("CUDAFORMERS_STREAM_LOAD", "1" if streamed else "0")
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", **kw)
    assert ("streamed to cuda" in model.explain()) == streamed
    return model


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_streamed_equals_tensor_by_tensor(folder, monkeypatch, dtype):
    old = _load(folder, False, monkeypatch, dtype=dtype)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    new = _load(folder, True, monkeypatch, dtype=dtype)
    print(new.explain())
    _same(new, old)
    # Staging is the device ring plus one large tensor (the embedding) at a time, on top of the model.
    model_bytes = torch.cuda.memory_allocated() - base
    largest = max(p.numel() for p in new.parameters()) * 2  # bf16 in the files
    ring = streaming.DEVICE_BUFFERS * streaming.CHUNK_BYTES
    assert torch.cuda.max_memory_allocated() - base <= model_bytes + largest + ring + (128 << 20)


def test_streamed_quantized_on_load(folder, monkeypatch):
    kw = dict(dtype=torch.bfloat16, quantization_config=Int8Config())
    _same(_load(folder, True, monkeypatch, **kw), _load(folder, False, monkeypatch, **kw))


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_streamed_gptq_and_awq_checkpoints(monkeypatch, kind):
    # GPTQ and AWQ layers keep their tensors until all of a layer's have arrived; tiny chunks reuse buffers.
    folder, qc = _gptq_folder(kind)
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(streaming, "DEVICE_BUFFERS", 1)
    new = _load(folder, True, monkeypatch, dtype=torch.float16, quantization_config=qc)
    old = _load(folder, False, monkeypatch, dtype=torch.float16, quantization_config=qc)
    _same(new, old)


@pytest.mark.parametrize("sizes", SIZES, ids=["tiny", "small", "one-unit"])
def test_stream_equals_safetensors_reader_on_gpu(tmp_path, sizes):
    files = _checkpoint(tmp_path)
    files.append(_write_raw(tmp_path / "odd.safetensors", {
        "u8": torch.arange(3, dtype=torch.uint8), "f32": torch.randn(5, 3), "flag": torch.tensor([True]),
        "bf16": torch.randn(9).bfloat16(), "i64": torch.arange(-4, 7)}))
    expected = {name: t for f in files for name, t in load_file(str(f)).items()}
    seen = set()
    for name, t, _ in stream_safetensors(files, "cuda", **sizes):
        assert t.device.type == "cuda" and t.dtype == expected[name].dtype and t.shape == expected[name].shape
        assert torch.equal(_bytes(t).cpu(), _bytes(expected[name])), name
        seen.add(name)
    assert seen == expected.keys()


def test_failed_streamed_load_is_clear_and_stops_readers(folder, tmp_path, monkeypatch):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 4096
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"safetensors: tensor .*mlp.*shape"):
        _load(bad, True, monkeypatch, dtype=torch.bfloat16)
    assert not [t for t in threading.enumerate() if t.name.startswith("cudaformers-read")]


def test_tiny_models_streamed_match_transformers(monkeypatch):
    monkeypatch.setenv("CUDAFORMERS_STREAM_LOAD", "1")
    folder = tiny.checkpoint("qwen2", shard=True)
    ours = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda")
    assert "streamed to cuda" in ours.explain()
    ref = tiny.hf_model(folder).cuda()
    ids = torch.randint(3, 211, (1, 20), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
