"""The streamed safetensors reader (loading/streaming.py) on its CPU path: every tensor equals
safetensors' own reader across dtypes, odd sizes, misaligned offsets, tensors larger than a chunk and
several shards; bad files raise CheckpointError naming the file; from_pretrained through it equals
transformers and the in-place path, including loaders that keep the tensors they are given."""

import json
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from cudaformers import AutoModelForCausalLM, FP8Config, Int8Config
from cudaformers.errors import CheckpointError
from cudaformers.loading import pretrained, streaming
from cudaformers.loading.streaming import read_header, stream_safetensors

SMALL = dict(chunk_bytes=1000, read_bytes=192, host_buffers=3, device_buffers=2, threads=2)
SIZES = [dict(chunk_bytes=64, read_bytes=64, host_buffers=1, device_buffers=1, threads=1),  # every tensor its own
         SMALL, dict(chunk_bytes=1 << 20, read_bytes=1 << 20, threads=4)]  # everything in one unit


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -1000), min(info.max, 1000)
        return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def _checkpoint(tmp_path, shards=3, seed=0):
    """Shards of many small tensors of every dtype and odd shape, plus one large tensor per shard."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.bool, torch.int64,
              torch.float8_e4m3fn]
    shapes = [(), (0,), (1,), (3, 5), (7, 1, 3), (33,), (2, 17)]
    files = []
    for s in range(shards):
        tensors = {f"s{s}.t{i}.{str(d)[6:]}": _random(shapes[i % len(shapes)], d, gen)
                   for i, d in enumerate(dtypes * 3)}
        tensors[f"s{s}.large"] = torch.randn(61, 29, generator=gen)  # 7076 bytes, several chunks and reads
        files.append(tmp_path / f"model-{s}.safetensors")
        save_file(tensors, str(files[-1]))
    return files


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _streamed(files, **kw) -> dict:
    # A yielded tensor lives only until the next one is taken: keep copies.
    return {name: (t.clone(), f) for name, t, f in stream_safetensors(files, "cpu", **kw)}


@pytest.mark.parametrize("sizes", SIZES, ids=["tiny", "small", "one-unit"])
def test_stream_equals_safetensors_reader(tmp_path, sizes):
    files = _checkpoint(tmp_path)
    got = _streamed(files, **sizes)
    expected = {name: (t, f) for f in files for name, t in load_file(str(f)).items()}
    assert got.keys() == expected.keys()
    for name, (t, f) in expected.items():
        mine, file = got[name]
        assert file == f and mine.dtype == t.dtype and mine.shape == t.shape, name
        assert torch.equal(_bytes(mine), _bytes(t)), name


def _write_raw(path, tensors: dict, metadata=None, pad=True):
    """A safetensors file with tensors in the given order and no alignment padding between them."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
             torch.bool: "BOOL", torch.int64: "I64"}
    header, data = {"__metadata__": metadata or {}}, b""
    for name, t in tensors.items():
        raw = bytes(_bytes(t).numpy())
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("sizes", SIZES[:2], ids=["tiny", "small"])
def test_misaligned_tensors(tmp_path, sizes):
    gen = torch.Generator().manual_seed(1)
    tensors = {"odd": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=gen),
               "f32": torch.randn(5, 3, generator=gen), "flag": torch.tensor([True]),
               "bf16": torch.randn(9, generator=gen).bfloat16(), "i64": torch.arange(-4, 7),
               "f16": torch.randn(2, 2, generator=gen).half()}
    file = _write_raw(tmp_path / "odd.safetensors", tensors)
    got = _streamed([file], **sizes)
    for name, t in tensors.items():
        assert torch.equal(got[name][0], t), name


def test_header_lists_tensors_in_file_order(tmp_path):
    file = _write_raw(tmp_path / "x.safetensors", {"b": torch.ones(2), "a": torch.zeros(3)}, metadata={"k": "v"})
    entries = read_header(file)
    assert [e.name for e in entries] == ["b", "a"]
    assert entries[0].end == entries[1].begin and entries[1].end == file.stat().st_size


def test_truncated_file_names_file_and_tensor(tmp_path):
    file = _write_raw(tmp_path / "cut.safetensors", {"w": torch.ones(10), "v": torch.ones(1000)})
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: tensor 'v' ends at .*truncated"):
        next(stream_safetensors([file], "cpu"))


def test_file_truncated_while_streaming(tmp_path):
    file = _write_raw(tmp_path / "shrinks.safetensors", {f"t{i}": torch.full((64,), float(i)) for i in range(20)})
    tensors = stream_safetensors([file], "cpu", chunk_bytes=256, read_bytes=256, host_buffers=1, threads=1)
    next(tensors)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"shrinks\.safetensors: ends at byte \d+, inside tensor 't\d+'"):
        list(tensors)


def _corrupt(tmp_path, kind):
    file = _write_raw(tmp_path / "bad.safetensors", {"w": torch.ones(4), "v": torch.ones(2)})
    data = bytearray(file.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    if kind == "short":
        data = data[:5]
    elif kind == "length":
        data[:8] = struct.pack("<Q", len(data))
    elif kind == "json":
        data[8:16] = b"garbage!"
    else:
        if kind == "overlap":
            header["v"]["data_offsets"] = [8, 16]
        elif kind == "size":
            header["w"]["shape"] = [5]
        elif kind == "fields":
            del header["w"]["dtype"]
        elif kind == "dtype":
            header["w"]["dtype"] = "Q7"
        text = json.dumps(header).encode().ljust(length)
        assert len(text) == length
        data[8:8 + length] = text
    file.write_bytes(bytes(data))
    return file


@pytest.mark.parametrize("kind,match", [("short", "header"), ("length", "header"), ("json", "header.*not JSON"),
                                        ("overlap", "'w' and 'v' overlap"), ("size", "'w'.*data_offsets"),
                                        ("fields", "'w' has no valid"), ("dtype", "'w' has dtype 'Q7'")])
def test_corrupt_header_names_the_file(tmp_path, kind, match):
    file = _corrupt(tmp_path, kind)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: .*" + match):
        next(stream_safetensors([file], "cpu"))


def test_readers_stop_when_the_consumer_stops(tmp_path):
    files = _checkpoint(tmp_path, shards=2)
    tensors = stream_safetensors(files, "cpu", **SIZES[0])
    next(tensors)
    tensors.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("cudaformers-read")]


# -- from_pretrained through the streamed path (on CPU: the CUDA path with plain buffers) ----------

@pytest.fixture
def streamed(monkeypatch):
    monkeypatch.setattr(pretrained, "_stream_target", lambda params: torch.device("cpu"))
    for name, value in dict(CHUNK_BYTES=4096, READ_BYTES=1536, HOST_BUFFERS=2, DEVICE_BUFFERS=2).items():
        monkeypatch.setattr(streaming, name, value)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("name,shard", [("qwen2", True), ("qwen3", False), ("llama_bias", False)])
def test_from_pretrained_streamed_equals_transformers(streamed, name, shard):
    folder = tiny.checkpoint(name, shard=shard)
    ours = AutoModelForCausalLM.from_pretrained(folder)
    assert "streamed to cpu" in ours.explain()
    ref = tiny.hf_model(folder)
    ids = torch.randint(3, 211, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_streamed_equals_in_place_bit_for_bit(monkeypatch):
    folder = tiny.checkpoint("qwen3", dtype="bfloat16", shard=True)
    in_place = _params(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16))
    monkeypatch.setattr(pretrained, "_stream_target", lambda params: torch.device("cpu"))
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 2048)
    got = _params(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16))
    assert got.keys() == in_place.keys()
    assert all(torch.equal(got[n], in_place[n]) for n in got)


def _gptq_folder(kind: str = "gptq"):
    from tests.test_quant_checkpoints import write_awq_checkpoint, write_gptq_checkpoint

    src = tiny.checkpoint("llama_mha_untied")  # asymmetric: zeros differ per layer
    folder, _ = write_awq_checkpoint(src, 32) if kind == "awq" else write_gptq_checkpoint(src, 32, False)
    return folder, json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("kind", ["int8", "gptq", "awq", "fp8_blocks"])
def test_loaders_keep_what_they_are_given(monkeypatch, kind):
    # GPTQ and AWQ layers hold qweight/qzeros/scales until all have arrived, and a block-scaled fp8
    # weight waits for its multipliers: with a staging buffer reused in between, a view would be overwritten.
    if kind == "fp8_blocks":
        from tests.test_quant_fp8_blocks import write_fp8_block_checkpoint

        folder, qc = write_fp8_block_checkpoint(tiny.checkpoint("llama_mha_untied"))[0], FP8Config(dequantize=True)
    else:
        folder, qc = _gptq_folder(kind) if kind != "int8" else (tiny.checkpoint("llama_bias"), Int8Config())
    in_place = _params(AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc))
    monkeypatch.setattr(pretrained, "_stream_target", lambda params: torch.device("cpu"))
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(streaming, "DEVICE_BUFFERS", 1)
    got = _params(AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc))
    assert all(torch.equal(got[n], in_place[n]) for n in in_place)


def test_streamed_shape_mismatch_names_tensor_and_file(streamed, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny.checkpoint("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model.safetensors.*mlp.*shape"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert not [t for t in threading.enumerate() if t.name.startswith("cudaformers-read")]


def test_stream_target_is_the_one_gpu_holding_everything(monkeypatch):
    from types import SimpleNamespace

    def params(*devices):
        return {f"p{i}": SimpleNamespace(device=torch.device(d)) for i, d in enumerate(devices)}

    monkeypatch.delenv("CUDAFORMERS_STREAM_LOAD", raising=False)
    assert pretrained._stream_target(params("cuda:0")) == torch.device("cuda:0")  # the default on one GPU
    monkeypatch.setenv("CUDAFORMERS_STREAM_LOAD", "1")
    assert pretrained._stream_target(params("cuda:0", "cuda:0")) == torch.device("cuda:0")
    assert pretrained._stream_target(params("cuda:0", "cuda:1")) is None  # device_map across GPUs
    assert pretrained._stream_target(params("cuda:0", "cpu")) is None  # offloaded
    assert pretrained._stream_target(params("cpu")) is None
    monkeypatch.setenv("CUDAFORMERS_STREAM_LOAD", "0")
    assert pretrained._stream_target(params("cuda:0")) is None


def test_load_throughput_is_logged_and_explained(streamed, caplog):
    with caplog.at_level("INFO", logger="cudaformers"):
        model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded weights:"))
    assert "GB/s, streamed to cpu" in line and line.endswith(model._choices["weights"])


def test_cpu_models_read_the_mapped_files_in_place():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), device_map="cpu")
    assert "GB/s, read in place" in model.explain()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_streamed_moe_experts_equal_in_place(monkeypatch, name):
    # Per-expert checkpoint tensors go to the stacked experts' loader.
    from tests.test_moe_models import checkpoint

    folder = checkpoint(name)
    in_place = _params(AutoModelForCausalLM.from_pretrained(folder))
    monkeypatch.setattr(pretrained, "_stream_target", lambda params: torch.device("cpu"))
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 3000)
    got = _params(AutoModelForCausalLM.from_pretrained(folder))
    assert got.keys() == in_place.keys()
    assert all(torch.equal(got[n], in_place[n]) for n in got)
