"""Loading: sharded files, dtypes, device maps, save/load round trips, and clear errors on bad input."""

import json
import shutil

import pytest
import torch

import tiny
from cudaformers import AutoModelForCausalLM
from cudaformers.errors import CheckpointError, UnsupportedError


def _copy(tmp_path, name="llama", **kw):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny.checkpoint(name, **kw), dst)
    return dst


def test_sharded_checkpoint_loads_and_matches():
    sharded = tiny.checkpoint("qwen2", shard=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    ref = tiny.hf_model(sharded)
    ours = AutoModelForCausalLM.from_pretrained(sharded)
    ids = torch.randint(3, 211, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,want", [("auto", torch.float32), ("bfloat16", torch.bfloat16),
                                        (torch.float16, torch.float16), ("float32", torch.float32)])
def test_dtype_argument(dtype, want):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype=dtype)
    assert all(p.dtype == want for p in model.parameters())


def test_auto_dtype_follows_checkpoint():
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama", dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(UnsupportedError, match="dtype="):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), dtype="int8")


def test_save_and_reload_round_trip(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3_tied"))
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.randint(3, 211, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits)
    ref = tiny.hf_model(tmp_path / "saved")  # transformers reads what we wrote
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_device_map_dict_and_auto_on_cpu():
    folder = tiny.checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(folder, device_map={"model": "cpu", "lm_head": "cpu"})
    assert model.device.type == "cpu"
    auto = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    assert auto.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UnsupportedError, match="does not place"):
        AutoModelForCausalLM.from_pretrained(folder, device_map={"model.layers": "cpu"})


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_device_map_by_unit_places_every_buffer(name):
    """The placement "auto" makes names each unit (embeddings, every layer, final norm, head), not the
    parameter-free rotary embedding: its buffers must not stay on the meta device."""
    from cudaformers.loading.device_map import placement_units

    folder = tiny.checkpoint(name)
    whole = AutoModelForCausalLM.from_pretrained(folder)
    by_unit = AutoModelForCausalLM.from_pretrained(folder, device_map={u: "cpu" for u in placement_units(whole)})
    assert not [n for n, t in [*by_unit.named_parameters(), *by_unit.named_buffers()] if t.is_meta]
    ids = torch.randint(3, 211, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert torch.equal(by_unit.generate(ids, **kw), whole.generate(ids, **kw))


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UnsupportedError, match="no GPU is visible"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), device_map="cuda")


def test_missing_weights_file(tmp_path):
    folder = _copy(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_missing_shard(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny.checkpoint("qwen2", shard=True), folder)
    next(folder.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_truncated_file(tmp_path):
    folder = _copy(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*(corrupt|truncated)"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_corrupt_header(tmp_path):
    folder = _copy(tmp_path)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:16] = b"garbage!"
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_unknown_architecture_lists_supported(tmp_path):
    folder = _copy(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    folder = _copy(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model.safetensors.*mlp.*shape"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_pickle_only_folder_is_refused(tmp_path):
    folder = _copy(tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_trust_remote_code_is_refused():
    with pytest.raises(UnsupportedError, match="never runs code"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), trust_remote_code=True)


def test_unknown_keyword_is_an_error():
    with pytest.raises(TypeError, match="unknown argument"):
        AutoModelForCausalLM.from_pretrained(tiny.checkpoint("llama"), not_a_real_option=1)


def test_units_on_another_gpu_run_with_it_current(monkeypatch):
    """Triton launches on the current CUDA device, not the tensors': a unit placed on another GPU runs
    with that GPU current, and the caller's device is current again after it (checked here with the
    device calls recorded and the moves stubbed, since this machine may have no GPU)."""
    from torch import nn

    from cudaformers.loading import device_map as dm

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d).index if
                                                                          not isinstance(d, int) else d))
    monkeypatch.setattr(dm, "_move", lambda x, device: x)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    monkeypatch.setattr(dm, "placement_units", lambda m: ["0", "1"])
    dm.install_device_hooks(model, {"0": torch.device("cuda", 0), "1": torch.device("cuda", 1)})
    model(torch.randn(2, 4))
    assert calls == [0, 0, 1, 0]  # unit 0: cuda:0 (and back); unit 1: cuda:1, then the caller's cuda:0
