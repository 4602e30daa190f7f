"""Device selection and the env report on fake GPU machines (torch.cuda and nvidia-smi monkeypatched)."""

import logging
from types import SimpleNamespace

import pytest
import torch

from cudaformers import device as dev
from cudaformers.errors import UnsupportedError

GiB = 2**30
H100 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * GiB)
V100 = dict(name="Tesla V100-SXM2-16GB", major=7, minor=0, total_memory=16 * GiB)


def fake_machine(monkeypatch, gpus, smi=None):
    """gpus: per cuda index, (spec, pci bus number). smi: nvidia-smi's csv output, or None for no nvidia-smi."""
    props = [SimpleNamespace(**spec, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0) for spec, bus in gpus]

    def get_props(index):
        assert isinstance(index, int) and 0 <= index < len(props), index
        return props[index]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_props)
    # Half of each GPU's memory is free.
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda i: (get_props(i).total_memory // 2, get_props(i).total_memory))
    monkeypatch.setattr(dev, "_run_nvidia_smi", lambda *fields: smi)
    monkeypatch.setattr(dev, "_proc_bus_ids", lambda: [])
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# Two H100s whose CUDA (fastest-first) order is the reverse of the PCI order nvidia-smi uses.
SMI_TWO = "0, 00000000:18:00.0\n1, 00000000:41:00.0\n"


@pytest.fixture
def two_swapped(monkeypatch):
    fake_machine(monkeypatch, [(H100, 0x41), (H100, 0x18)], smi=SMI_TWO)


@pytest.fixture
def no_gpu(monkeypatch):
    fake_machine(monkeypatch, [], smi=None)


def test_pci_parsing_round_trip():
    assert dev.parse_pci("00000000:1B:00.0") == (0, 0x1B, 0, 0)
    assert dev.parse_pci("0000:c1:00.1") == (0, 0xC1, 0, 1)
    assert dev.parse_pci("GPU-1234") is None
    assert dev.format_pci((0, 0x1B, 0, 0)) == "00000000:1B:00.0"
    assert dev.parse_nvidia_smi("1, 00000000:41:00.0\n0, 00000000:18:00.0\ngarbage\n") == {
        (0, 0x41, 0, 0): 1, (0, 0x18, 0, 0): 0}


def test_default_device_cpu_without_gpu(no_gpu):
    assert dev.default_device() == torch.device("cpu")
    assert dev.resolve_device(None) == torch.device("cpu")
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device("meta") == torch.device("meta")


def test_default_device_is_first_gpu_or_local_rank(two_swapped, monkeypatch, caplog):
    dev._logged_defaults.clear()
    with caplog.at_level(logging.INFO, logger="cudaformers"):
        assert dev.default_device() == torch.device("cuda", 0)
    assert "default device: cuda:0" in caplog.text
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dev.default_device() == torch.device("cuda", 1)
    assert dev.resolve_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UnsupportedError, match=r"LOCAL_RANK=2 but only 2 GPU.*nproc-per-node=2"):
        dev.default_device()


def test_resolve_device_forms(two_swapped):
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve_device(1) == torch.device("cuda", 1)
    assert dev.resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert dev.resolve_device(" cuda ") == torch.device("cuda", 0)


def test_resolve_device_missing_index_names_visible_devices(two_swapped, monkeypatch):
    with pytest.raises(UnsupportedError, match=r"cuda:2 does not exist: 2 GPU\(s\).*cuda:0..cuda:1.*"
                                               r"CUDA_VISIBLE_DEVICES is not set"):
        dev.resolve_device("cuda:2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(UnsupportedError, match=r"CUDA_VISIBLE_DEVICES='4,5'"):
        dev.resolve_device(7)


@pytest.mark.parametrize("bad, message", [
    (-1, "negative"), ("gpu", "unknown device 'gpu'"), ("auto", "device_map value"),
    ("mps", "not supported"), (1.0, "must be a string"), (True, "must be a string")])
def test_resolve_device_rejects_bad_input(two_swapped, bad, message):
    with pytest.raises(UnsupportedError, match=message):
        dev.resolve_device(bad)


def test_cuda_without_gpu_is_a_clear_error(no_gpu, monkeypatch):
    for asked in ("cuda", "cuda:0", 0):
        with pytest.raises(UnsupportedError, match="no GPU is visible.*use device 'cpu'"):
            dev.resolve_device(asked)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UnsupportedError, match="CUDA_VISIBLE_DEVICES is set to an empty string"):
        dev.resolve_device("cuda")


def test_bf16_support_and_dtype_check(monkeypatch):
    fake_machine(monkeypatch, [(H100, 0x18), (V100, 0x3B)], smi=None)
    assert dev.device_capability("cuda:1") == (7, 0)
    assert dev.device_capability("cpu") is None
    assert dev.supports_bf16("cuda:0") and dev.supports_bf16("cpu")
    assert not dev.supports_bf16("cuda:1")
    dev.check_dtype_supported(torch.bfloat16, "cuda:0")
    dev.check_dtype_supported(torch.float16, "cuda:1")
    dev.check_dtype_supported(torch.bfloat16, "cpu")
    with pytest.raises(UnsupportedError, match=r"cuda:1 \(Tesla V100.*capability 7.0\).*dtype=torch.float16"):
        dev.check_dtype_supported(torch.bfloat16, 1)


def test_free_memory(two_swapped):
    assert dev.free_memory("cuda:1") == 40 * GiB
    assert dev.free_memory("cpu") > 0
    with pytest.raises(UnsupportedError, match="meta"):
        dev.free_memory("meta")


def test_visible_devices_map_through_pci_bus(two_swapped):
    gpus = dev.visible_devices(with_free_memory=True)
    assert [(g.cuda_index, g.physical_index, g.pci_bus_id) for g in gpus] == [
        (0, 1, "00000000:41:00.0"), (1, 0, "00000000:18:00.0")]
    assert gpus[0].free_memory == 40 * GiB and gpus[0].bf16 and gpus[0].capability == (9, 0)
    assert dev.visible_devices()[0].free_memory is None


def test_physical_order_from_proc_when_no_nvidia_smi(monkeypatch):
    fake_machine(monkeypatch, [(H100, 0x41), (H100, 0x18)], smi=None)
    monkeypatch.setattr(dev, "_proc_bus_ids", lambda: [(0, 0x18, 0, 0), (0, 0x41, 0, 0)])
    assert [g.physical_index for g in dev.visible_devices()] == [1, 0]
    monkeypatch.setattr(dev, "_proc_bus_ids", lambda: [])
    assert [g.physical_index for g in dev.visible_devices()] == [None, None]


def test_expected_physical_order():
    assert dev.expected_physical_order(None, 3) == [0, 1, 2]
    assert dev.expected_physical_order("3, 1", 2) == [3, 1]
    assert dev.expected_physical_order("2,-1,0", 1) == [2]
    assert dev.expected_physical_order("GPU-8f0e2c1a", 1) is None


def test_report_warns_when_cuda_order_differs_from_nvidia_smi(two_swapped):
    report = dev.collect_report()
    assert [d["physical_index"] for d in report["devices"]] == [1, 0]
    assert report["physical_gpu_count"] == 2
    text = dev.format_report(report)
    assert "not set: all GPUs visible" in text
    assert "CUDA_DEVICE_ORDER is not set: with 2 GPUs" in text
    assert ("CUDA's numbering differs from nvidia-smi's (all GPUs visible): "
            "cuda:0 is nvidia-smi GPU 1, not 0; cuda:1 is nvidia-smi GPU 0, not 1;") in text
    assert "00000000:41:00.0" in text and "40.0 / 80.0" in text


def test_report_with_pci_bus_order_and_matching_selection(monkeypatch):
    # With PCI_BUS_ID, CUDA_VISIBLE_DEVICES=1,0 means nvidia-smi GPUs 1 then 0: the order the user asked for.
    fake_machine(monkeypatch, [(H100, 0x41), (H100, 0x18)], smi=SMI_TWO)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    report = dev.collect_report()
    assert report["warnings"] == []
    assert "'1,0', inherited from the environment" in dev.format_report(report)


def test_report_warns_about_selection_on_fastest_first(monkeypatch):
    # One GPU visible out of two: the order warning still applies, since CUDA_VISIBLE_DEVICES=0 was
    # read in FASTEST_FIRST order and picked nvidia-smi's GPU 1.
    fake_machine(monkeypatch, [(H100, 0x41)], smi=SMI_TWO)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    warnings = dev.collect_report()["warnings"]
    assert len(warnings) == 2
    assert "CUDA_DEVICE_ORDER is 'FASTEST_FIRST': with 2 GPUs" in warnings[0]
    assert "(CUDA_VISIBLE_DEVICES='0' read as nvidia-smi indices): cuda:0 is nvidia-smi GPU 1, not 0;" in warnings[1]


def test_single_gpu_machine_has_no_order_warning(monkeypatch):
    fake_machine(monkeypatch, [(H100, 0x18)], smi="0, 00000000:18:00.0\n")
    assert dev.collect_report()["warnings"] == []


def test_unknown_device_order_value_is_flagged(monkeypatch):
    fake_machine(monkeypatch, [(H100, 0x18)], smi="0, 00000000:18:00.0\n")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "pci")
    assert "'pci' is not a value CUDA knows" in dev.collect_report()["warnings"][0]


def test_report_without_gpu_says_cpu_only(no_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = dev.collect_report()
    assert report["device_count"] == 0 and report["devices"] == [] and report["warnings"] == []
    text = dev.format_report(report)
    assert "set to an empty string: no GPU visible, CPU only" in text
    assert "note: CPU only: CUDA_VISIBLE_DEVICES is set to an empty string" in text
    assert "nvidia-smi" not in text  # no device table


def test_triton_runs_on_cuda_or_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert dev.triton_runs_on("cuda:0") and dev.triton_runs_on(torch.device("cuda")) and not dev.triton_runs_on("cpu")
    for value, runs in [("1", True), ("true", True), ("0", False), ("", False)]:
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert dev.triton_runs_on("cpu") is runs
