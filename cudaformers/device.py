"""Which device runs the model: the visible GPUs, how CUDA numbers them, what each can do, and the
`cudaformers env` report that makes the numbering visible.

CUDA numbers GPUs ``cuda:0..n-1`` after ``CUDA_VISIBLE_DEVICES`` has picked and reordered them, and
by default (``CUDA_DEVICE_ORDER=FASTEST_FIRST``) it may order them differently from nvidia-smi,
which numbers GPUs by PCI bus. The PCI bus id is the one name both agree on, so the report maps
each ``cuda:i`` to nvidia-smi's index through it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

import torch

from .errors import UnsupportedError

logger = logging.getLogger("cudaformers")

_PCI = re.compile(r"([0-9a-fA-F]+):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")
_PROC_GPUS = "/proc/driver/nvidia/gpus"
_logged_defaults: set[str] = set()


@dataclass
class GPUInfo:
    cuda_index: int                   # the N in cuda:N, after CUDA_VISIBLE_DEVICES
    name: str
    pci_bus_id: str | None            # nvidia-smi's spelling, e.g. "00000000:18:00.0"
    physical_index: int | None        # nvidia-smi's index for the same GPU; None when unknown
    total_memory: int                 # bytes
    free_memory: int | None           # bytes; None unless asked for (it creates a CUDA context)
    capability: tuple[int, int]
    bf16: bool


# -- devices the library uses ---------------------------------------------------------------------

def default_device() -> torch.device:
    """cuda:0 when a GPU is visible (under torchrun, the GPU of this process's LOCAL_RANK), else cpu."""
    if not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", _local_rank())
    if str(device) not in _logged_defaults:
        _logged_defaults.add(str(device))
        why = "no GPU visible" if device.type == "cpu" else (
            "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "first visible GPU")
        logger.info("default device: %s (%s)", device, why)
    return device


def _local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return 0
    try:
        rank = int(raw)
    except ValueError:
        raise UnsupportedError(f"LOCAL_RANK={raw!r} is not an integer; it is set by torchrun, do not set it by hand")
    count = torch.cuda.device_count()
    if not 0 <= rank < count:
        raise UnsupportedError(
            f"LOCAL_RANK={rank} but only {count} GPU(s) are visible ({_visible_devices_clause()}); "
            f"launch at most {count} processes per node (torchrun --nproc-per-node={count}) or make more GPUs visible")
    return rank


def resolve_device(device: str | int | torch.device | None = None) -> torch.device:
    """A validated torch.device: "cpu", "cuda" (the default GPU), "cuda:N", N, "meta", or None (default)."""
    if device is None:
        return default_device()
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise UnsupportedError(f"device must be a string like 'cuda:0', an int or a torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise UnsupportedError(f"device index {device} is negative; GPUs are numbered from 0 (cuda:0)")
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            device = torch.device(device.strip())
        except RuntimeError:
            raise UnsupportedError(
                f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or an int N"
                + (" ('auto' is a device_map value, not a device)" if device.strip() == "auto" else "")) from None
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.type != "cuda":
        raise UnsupportedError(f"device {str(device)!r} is not supported; cudaformers runs on 'cuda' GPUs or 'cpu'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UnsupportedError(f"{str(device)!r} was asked for but no GPU is visible ({_no_gpu_reason()}); "
                               "use device 'cpu' or fix the GPU setup (`cudaformers env` shows what torch sees)")
    if device.index is None:
        return default_device()
    if device.index >= count:
        raise UnsupportedError(
            f"cuda:{device.index} does not exist: {count} GPU(s) are visible, cuda:0..cuda:{count - 1} "
            f"({_visible_devices_clause()}); `cudaformers env` lists them with nvidia-smi's numbers")
    return device


def _visible_devices_clause() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is not set" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def _no_gpu_reason() -> str:
    if os.environ.get("CUDA_VISIBLE_DEVICES", "-").strip() == "":
        return "CUDA_VISIBLE_DEVICES is set to an empty string, which hides every GPU"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return f"{_visible_devices_clause()} selects no usable GPU, or no NVIDIA driver is loaded"
    return "no NVIDIA driver is loaded or no GPU is installed"


def triton_runs_on(device: str | int | torch.device) -> bool:
    """Whether Triton kernels run for tensors on ``device``: CUDA, or anywhere under ``TRITON_INTERPRET``
    (the CPU tests). Reads no Triton, so callers can decide before importing a kernel module."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_capability(device: str | int | torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a GPU; None for cpu and meta."""
    device = resolve_device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device.index)
    return props.major, props.minor


def supports_bf16(device: str | int | torch.device) -> bool:
    """Whether bfloat16 runs natively. On GPUs that needs compute capability 8.0 (Ampere) or newer:
    torch.cuda.is_bf16_supported() also says yes to emulated bf16, which our Triton kernels cannot use."""
    capability = device_capability(device)
    return capability is None or capability >= (8, 0)


def check_dtype_supported(dtype: torch.dtype, device: str | int | torch.device) -> None:
    """Raise UnsupportedError, naming the fix, when `device` cannot run `dtype`."""
    device = resolve_device(device)
    if dtype == torch.bfloat16 and not supports_bf16(device):
        props = torch.cuda.get_device_properties(device.index)
        major, minor, name = props.major, props.minor, props.name
        raise UnsupportedError(
            f"{device} ({name}, compute capability {major}.{minor}) has no bfloat16 support, which needs "
            f"compute capability 8.0 (Ampere) or newer; load the model with dtype=torch.float16")


def free_memory(device: str | int | torch.device) -> int:
    """Bytes free on a GPU (cudaMemGetInfo) or available system memory for cpu."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device.index)[0]
    if device.type == "meta":
        raise UnsupportedError("the meta device holds no memory; ask about 'cpu' or a 'cuda:N' device")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def visible_devices(with_free_memory: bool = False, physical: dict[tuple, int] | None = None) -> list[GPUInfo]:
    """The GPUs torch sees, in cuda:N order, each mapped to nvidia-smi's index through its PCI bus id
    (`physical`, from physical_gpu_indices() when not given)."""
    if not torch.cuda.is_available():
        return []
    physical = physical_gpu_indices() if physical is None else physical
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = _props_pci(props)
        capability = (props.major, props.minor)
        gpus.append(GPUInfo(
            cuda_index=i, name=props.name, pci_bus_id=format_pci(bus) if bus else None,
            physical_index=physical.get(bus) if physical and bus else None,
            total_memory=props.total_memory,
            free_memory=torch.cuda.mem_get_info(i)[0] if with_free_memory else None,
            capability=capability, bf16=capability >= (8, 0)))
    return gpus


# -- the physical (nvidia-smi) numbering ----------------------------------------------------------

def parse_pci(text: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) from "00000000:18:00.0" or "0000:18:00.0"."""
    match = _PCI.search(text)
    return tuple(int(part, 16) for part in match.groups()) if match else None


def format_pci(bus: tuple[int, int, int, int]) -> str:
    return f"{bus[0]:08X}:{bus[1]:02X}:{bus[2]:02X}.{bus[3]:X}"


def _props_pci(props) -> tuple[int, int, int, int] | None:
    # pci_* fields are torch's copies of cudaDeviceProp.pciDomainID/pciBusID/pciDeviceID.
    fields = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return None if None in fields else (*fields, 0)


def parse_nvidia_smi(text: str) -> dict[tuple, int]:
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` -> {pci: index}."""
    result = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and (bus := parse_pci(parts[1])):
            result[bus] = int(parts[0])
    return result


def _run_nvidia_smi(*fields: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _proc_bus_ids() -> list[tuple[int, int, int, int]]:
    try:
        names = os.listdir(_PROC_GPUS)
    except OSError:
        return []
    return sorted(bus for name in names if (bus := parse_pci(name)))


def physical_gpu_indices() -> dict[tuple, int] | None:
    """{pci: nvidia-smi index} for every GPU in the machine, whatever CUDA_VISIBLE_DEVICES says; None
    when neither nvidia-smi nor the driver's /proc files are there."""
    text = _run_nvidia_smi("index", "pci.bus_id")
    if text is not None and (found := parse_nvidia_smi(text)):
        return found
    # nvidia-smi (NVML) numbers GPUs in PCI bus order, so sorting the driver's entries reproduces it.
    found = {bus: i for i, bus in enumerate(_proc_bus_ids())}
    return found or None


def driver_version() -> str | None:
    text = _run_nvidia_smi("driver_version")
    if text and text.strip():
        return text.splitlines()[0].strip()
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", f.read())
        return match.group(1) if match else None
    except OSError:
        return None


def driver_cuda_version() -> str | None:
    """The newest CUDA version the installed driver supports (cuDriverGetVersion; needs no context)."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def expected_physical_order(visible: str | None, count: int) -> list[int] | None:
    """nvidia-smi indices a user means by CUDA_VISIBLE_DEVICES (integers are read as nvidia-smi's
    numbers), or None when it names GPUs by UUID/MIG id and no order is implied."""
    if visible is None:
        return list(range(count))
    indices = []
    for token in visible.split(","):
        token = token.strip()
        if re.fullmatch(r"-\d+", token):
            break  # CUDA stops reading at the first negative index
        if not token.isdigit():
            return None
        indices.append(int(token))
    return indices[:count]


def order_warnings(gpus: list[GPUInfo], physical_count: int | None, visible: str | None,
                   device_order: str | None) -> list[str]:
    """The ways cuda:N may not be the GPU the user thinks it is."""
    warnings = []
    if device_order not in (None, "FASTEST_FIRST", "PCI_BUS_ID"):
        warnings.append(f"CUDA_DEVICE_ORDER={device_order!r} is not a value CUDA knows "
                        "(FASTEST_FIRST or PCI_BUS_ID); export CUDA_DEVICE_ORDER=PCI_BUS_ID")
    machine_gpus = physical_count if physical_count is not None else len(gpus)
    if device_order != "PCI_BUS_ID" and machine_gpus > 1:
        warnings.append(
            f"CUDA_DEVICE_ORDER is {'not set' if device_order is None else repr(device_order)}: with "
            f"{machine_gpus} GPUs, CUDA's FASTEST_FIRST numbering (the default; also used to read "
            "CUDA_VISIBLE_DEVICES) can differ from nvidia-smi's; export CUDA_DEVICE_ORDER=PCI_BUS_ID")
    expected = expected_physical_order(visible, len(gpus))
    actual = [gpu.physical_index for gpu in gpus]
    if expected is not None and None not in actual and len(expected) == len(actual) and expected != actual:
        pairs = "; ".join(f"cuda:{gpu.cuda_index} is nvidia-smi GPU {gpu.physical_index}, "
                          f"not {expected[gpu.cuda_index]}" for gpu in gpus
                          if gpu.physical_index != expected[gpu.cuda_index])
        meant = ("all GPUs visible" if visible is None
                 else f"CUDA_VISIBLE_DEVICES={visible!r} read as nvidia-smi indices")
        warnings.append(f"CUDA's numbering differs from nvidia-smi's ({meant}): {pairs}; "
                        "export CUDA_DEVICE_ORDER=PCI_BUS_ID so that both agree")
    return warnings


# -- `cudaformers env` ----------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # an optional package that is absent or broken is reported, not fatal
        return None


def collect_report() -> dict:
    """Everything `cudaformers env` shows, as plain JSON-ready data."""
    import platform

    from . import __version__

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    device_order = os.environ.get("CUDA_DEVICE_ORDER")
    physical = physical_gpu_indices()
    gpus = visible_devices(with_free_memory=True, physical=physical or {})
    return {
        "cudaformers": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "driver": driver_version(),
        "driver_cuda": driver_cuda_version(),
        "triton": _version("triton"),
        "cuda_available": torch.cuda.is_available(),
        "device_count": len(gpus),
        "physical_gpu_count": len(physical) if physical else None,
        "CUDA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": device_order,
        "devices": [asdict(gpu) for gpu in gpus],
        "notes": [] if gpus else [f"CPU only: {_no_gpu_reason()}"],
        "warnings": order_warnings(gpus, len(physical) if physical else None, visible, device_order),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def format_report(report: dict) -> str:
    visible, order = report["CUDA_VISIBLE_DEVICES"], report["CUDA_DEVICE_ORDER"]
    if visible is None:
        visible_text = "not set: all GPUs visible"
    elif visible.strip() == "":
        visible_text = "set to an empty string: no GPU visible, CPU only"
    else:
        visible_text = (f"{visible!r}, inherited from the environment: only these GPUs are visible "
                        "(a forgotten export silently moves runs to other GPUs)")
    driver = report["driver"] or "not found"
    if report["driver_cuda"]:
        driver += f" (supports CUDA {report['driver_cuda']})"
    summary = [
        ["cudaformers", report["cudaformers"]],
        ["python", report["python"]],
        ["torch", report["torch"]],
        ["CUDA runtime", report["cuda_runtime"] or "none: CPU-only build of torch"],
        ["NVIDIA driver", driver],
        ["triton", report["triton"] or "not importable"],
        ["cuda available", str(report["cuda_available"])],
        ["visible GPUs", str(report["device_count"])
         + (f" of {report['physical_gpu_count']} in this machine" if report["physical_gpu_count"] else "")],
        ["CUDA_VISIBLE_DEVICES", visible_text],
        ["CUDA_DEVICE_ORDER", order if order is not None else "not set (CUDA default: FASTEST_FIRST)"],
    ]
    lines = _table(summary)
    if report["devices"]:
        rows = [["device", "nvidia-smi", "name", "PCI bus id", "free / total GiB", "capability", "bf16"]]
        for gpu in report["devices"]:
            rows.append([
                f"cuda:{gpu['cuda_index']}",
                "unknown" if gpu["physical_index"] is None else str(gpu["physical_index"]),
                gpu["name"], gpu["pci_bus_id"] or "unknown",
                f"{_gib(gpu['free_memory'])} / {_gib(gpu['total_memory'])}",
                "{}.{}".format(*gpu["capability"]), "yes" if gpu["bf16"] else "no"])
        lines += ["", *_table(rows)]
    lines += [""] * bool(report["notes"] or report["warnings"])
    lines += [f"note: {note}" for note in report["notes"]]
    lines += [f"warning: {warning}" for warning in report["warnings"]]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    import json

    report = collect_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
