"""`cudaformers env` run as a user runs it: a fresh process under a chosen environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env_report(*args, **env_vars):
    """Run `python -m cudaformers.cli env` with CUDA_* variables set as given (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update({k: v for k, v in env_vars.items() if v is not None})
    done = subprocess.run([sys.executable, "-m", "cudaformers.cli", "env", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def field(text, name):
    """The value column of a summary line of the text report."""
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, text
    return lines[0][len(name):].strip()


def test_empty_visible_devices_reports_cpu_only():
    text = env_report(CUDA_VISIBLE_DEVICES="")
    assert field(text, "CUDA_VISIBLE_DEVICES") == "set to an empty string: no GPU visible, CPU only"
    assert field(text, "cuda available") == "False"
    assert field(text, "visible GPUs").split()[0] == "0"
    assert "note: CPU only: CUDA_VISIBLE_DEVICES is set to an empty string, which hides every GPU" in text
    assert "cuda:0" not in text

    report = json.loads(env_report("--json", CUDA_VISIBLE_DEVICES=""))
    assert report["CUDA_VISIBLE_DEVICES"] == "" and report["device_count"] == 0 and report["devices"] == []
    assert report["cuda_available"] is False


def test_unset_variables_and_versions():
    import torch

    text = env_report()
    assert field(text, "CUDA_VISIBLE_DEVICES") == "not set: all GPUs visible"
    assert field(text, "CUDA_DEVICE_ORDER") == "not set (CUDA default: FASTEST_FIRST)"
    assert field(text, "torch") == torch.__version__
    assert field(text, "python") == "{}.{}.{}".format(*sys.version_info[:3])
    if torch.version.cuda is None:
        assert field(text, "CUDA runtime") == "none: CPU-only build of torch"
        assert "note: CPU only: torch" in text and "is a CPU-only build; install a CUDA build of torch" in text


def test_inherited_visible_devices_and_pci_order():
    text = env_report(CUDA_VISIBLE_DEVICES="1,0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    visible = field(text, "CUDA_VISIBLE_DEVICES")
    assert visible.startswith("'1,0', inherited from the environment")
    assert "a forgotten export silently moves runs to other GPUs" in visible
    assert field(text, "CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    assert "CUDA_DEVICE_ORDER is" not in text  # PCI_BUS_ID is what we recommend: no warning


def test_unknown_device_order_is_a_warning():
    order = "PCI"
    report = json.loads(env_report("--json", CUDA_DEVICE_ORDER=order))
    assert report["CUDA_DEVICE_ORDER"] == order
    assert any(f"CUDA_DEVICE_ORDER={order!r} is not a value CUDA knows" in w for w in report["warnings"])
    assert set(report) >= {"python", "torch", "cuda_runtime", "driver", "driver_cuda", "triton", "cuda_available",
                           "device_count", "physical_gpu_count", "devices", "notes", "warnings"}
