"""The device report on a real GPU, checked against what torch and nvidia-smi say independently."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cudaformers import device as dev

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def smi_table():
    """{nvidia-smi index: (PCI bus id, name)} straight from nvidia-smi, or from the driver's /proc files."""
    exe = shutil.which("nvidia-smi")
    if exe:
        out = subprocess.run([exe, "--query-gpu=index,pci.bus_id,name", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        rows = [[part.strip() for part in line.split(",", 2)] for line in out.splitlines() if line.strip()]
        return {int(i): (dev.parse_pci(bus), name) for i, bus, name in rows}
    buses = sorted(dev.parse_pci(name) for name in os.listdir("/proc/driver/nvidia/gpus"))
    return {i: (bus, None) for i, bus in enumerate(buses)}


def run_env(**env_vars):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(env_vars)
    done = subprocess.run([sys.executable, "-m", "cudaformers.cli", "env", "--json"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_visible_devices_match_torch_and_nvidia_smi():
    table = smi_table()
    gpus = dev.visible_devices(with_free_memory=True)
    assert len(gpus) == torch.cuda.device_count() >= 1
    for gpu in gpus:
        props = torch.cuda.get_device_properties(gpu.cuda_index)
        assert gpu.name == props.name
        assert gpu.capability == (props.major, props.minor)
        assert gpu.physical_index is not None, "PCI bus id not mapped to nvidia-smi's index"
        bus, smi_name = table[gpu.physical_index]
        assert dev.parse_pci(gpu.pci_bus_id) == bus
        assert smi_name is None or smi_name == gpu.name
        assert 0 < gpu.free_memory <= gpu.total_memory == props.total_memory
        if "H200" in gpu.name or "H100" in gpu.name:
            assert gpu.capability == (9, 0) and gpu.bf16


def test_bf16_and_default_device_on_gpu():
    assert dev.default_device() == dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.supports_bf16("cuda:0") == (torch.cuda.get_device_capability(0) >= (8, 0))
    if dev.supports_bf16(0):
        dev.check_dtype_supported(torch.bfloat16, 0)
        x = torch.ones(4, dtype=torch.bfloat16, device="cuda")
        assert (x @ x).item() == 4
    assert 0 < dev.free_memory("cuda:0") <= torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(Exception, match=f"cuda:{torch.cuda.device_count()} does not exist"):
        dev.resolve_device(torch.cuda.device_count())


def test_env_report_selects_the_nvidia_smi_gpu_named_in_visible_devices():
    # With PCI_BUS_ID order, CUDA_VISIBLE_DEVICES=<last nvidia-smi index> must show exactly that GPU.
    table = smi_table()
    last = max(table)
    report = run_env(CUDA_VISIBLE_DEVICES=str(last), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert report["device_count"] == 1 and report["physical_gpu_count"] == len(table)
    (gpu,) = report["devices"]
    assert gpu["cuda_index"] == 0 and gpu["physical_index"] == last
    assert dev.parse_pci(gpu["pci_bus_id"]) == table[last][0]
    assert report["warnings"] == []
    assert report["cuda_runtime"] == torch.version.cuda and report["driver"]


def test_env_text_report_lists_the_gpu():
    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "cudaformers.cli", "env"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    name = torch.cuda.get_device_name(0)
    row = next(line for line in out.splitlines() if line.startswith("cuda:0 "))
    assert name in row and row.rstrip().endswith("yes" if dev.supports_bf16(0) else "no")
    print(out)
