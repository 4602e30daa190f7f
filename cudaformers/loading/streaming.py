"""Safetensors checkpoints streamed to a GPU at page-cache speed.

Copying each mmap'd tensor to the GPU one at a time goes through the driver's small pageable staging
buffer and faults pages in on first touch: 2-5 GB/s. Here reader threads ``pread`` the files in large
sequential pieces into a ring of pinned host buffers, each piece is copied asynchronously to a device
staging buffer on a side stream, and the consumer gets every tensor as a typed view of that buffer on
its device. Reads, host-to-device copies and the consumer's device-side work all overlap.

    file --pread (threads)--> pinned ring [HOST_BUFFERS x READ_BYTES]
         --H2D (side stream)--> device ring [DEVICE_BUFFERS x CHUNK_BYTES] --> views --> consumer

Tensors are grouped, in file order, into units of at most CHUNK_BYTES; a tensor larger than that is a
unit of its own and gets its own device buffer for as long as it is in use. The stream waits on
events, never on the host, except a reader that must wait for a pinned buffer to be copied out.

With a CPU ``device`` the same machinery runs with ordinary buffers and synchronous copies, which is
how it is tested without a GPU.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from ..errors import CheckpointError

CHUNK_BYTES = 128 << 20  # one device staging unit
DEVICE_BUFFERS = 3
READ_BYTES = 32 << 20  # one pread into one pinned host buffer
HOST_BUFFERS = 6
READ_THREADS = 4
_ALIGN = 64  # units start on this file offset, so tensors aligned in the file stay aligned in the buffer
_MAX_HEADER = 100 << 20  # the limit the safetensors library enforces

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_DTYPES.update({name: getattr(torch, attr) for name, attr in (
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")) if hasattr(torch, attr)})


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file in file order, checked against the file's size."""
    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: corrupt safetensors header ({why}); download the file again")

    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(f"the file has only {size} bytes")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER, size - 8):
                raise corrupt(f"it claims {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"not JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from e
    if not isinstance(header, dict):
        raise corrupt("not a JSON object")
    start = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as err:
            raise corrupt(f"tensor {name!r} has no valid dtype/shape/data_offsets: {err!r}") from err
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_name!r}, which this torch cannot "
                                  f"hold (known: {sorted(_DTYPES)})")
        if not (isinstance(b, int) and isinstance(e, int)) or not 0 <= b <= e \
                or e - b != prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
            raise corrupt(f"tensor {name!r}: data_offsets {[b, e]} do not hold a {dtype_name} {list(shape)}")
        if start + e > size:
            raise CheckpointError(f"{file}: tensor {name!r} ends at byte {start + e} but the file has {size} bytes; "
                                  "the file is truncated: download it again")
        entries.append(TensorEntry(name, dtype, shape, start + b, start + e))
    entries.sort(key=lambda t: t.begin)
    for prev, cur in zip(entries, entries[1:]):
        if cur.begin < prev.end:
            raise corrupt(f"tensors {prev.name!r} and {cur.name!r} overlap")
    return entries


@dataclass
class _Unit:
    file: Path
    start: int  # the byte range [start, end) of the file that lands in one device buffer
    end: int
    entries: list[TensorEntry] = field(default_factory=list)


def _units(file: Path, entries: list[TensorEntry], chunk_bytes: int) -> list[_Unit]:
    units: list[_Unit] = []
    for t in entries:
        if units and t.end - units[-1].start <= chunk_bytes:
            units[-1].entries.append(t)
            units[-1].end = t.end
        else:
            units.append(_Unit(file, t.begin - t.begin % _ALIGN, t.end, [t]))
    return units


class _Staging:
    """Device side: a ring of unit-sized buffers filled on a side stream (CUDA) or by plain copies (CPU).

    A ring buffer is refilled only after the consumer's stream has finished with its previous unit
    (an event, waited on by the side stream); the consumer's stream waits for a unit's copies likewise.
    """

    def __init__(self, device: torch.device, slot_bytes: int, slots: int):
        self.device, self.slot_bytes = device, slot_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.ring: list[torch.Tensor | None] = [None] * slots
        self.consumed: list = [None] * slots  # per ring buffer: the consumer's last use of it
        self.slot, self.filled = None, -1  # the ring buffer in use (None: a buffer of its own)

    def _fresh(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:  # the allocator may hand out memory the consumer's stream still reads
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return buf

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer for the next unit: the next ring buffer, or a buffer of its own for a large unit."""
        if nbytes > self.slot_bytes:
            self.slot = None
            return self._fresh(nbytes)
        self.filled += 1
        self.slot = self.filled % len(self.ring)
        if self.ring[self.slot] is None:
            self.ring[self.slot] = self._fresh(self.slot_bytes)
        elif self.consumed[self.slot] is not None:
            self.stream.wait_event(self.consumed[self.slot])
        return self.ring[self.slot][:nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Start ``dst <- src``; returns the event after which ``src`` may be refilled (None: it may now)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        return self.stream.record_event()

    def publish(self) -> None:
        """The consumer's stream waits for the copies issued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.stream.record_event())

    def release(self) -> None:
        """The consumer has issued all its work on the unit last acquired."""
        if self.cuda and self.slot is not None:
            self.consumed[self.slot] = torch.cuda.current_stream(self.device).record_event()


def _view(buf: torch.Tensor, unit: _Unit, t: TensorEntry) -> torch.Tensor:
    raw = buf[t.begin - unit.start: t.end - unit.start]
    if (t.begin - unit.start) % t.dtype.itemsize:
        raw = raw.clone()  # a misaligned tensor (after an odd-sized one) cannot be viewed in place
    return raw.view(t.dtype).view(t.shape)


def stream_safetensors(files: list[Path], device, *, chunk_bytes: int | None = None, read_bytes: int | None = None,
                       host_buffers: int | None = None, device_buffers: int | None = None,
                       threads: int | None = None) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor on ``device``, file) for every tensor of ``files``, in file order.

    A yielded tensor is valid only until the next one is requested: it views a staging buffer that is
    then reused. Keep a ``.clone()`` to hold on to it. All headers are checked before any data moves.
    """
    device = torch.device(device)
    chunk_bytes, read_bytes = chunk_bytes or CHUNK_BYTES, read_bytes or READ_BYTES
    units = [u for f in files for u in _units(f, read_header(f), chunk_bytes)]
    if not units:
        return
    small = [u.end - u.start for u in units if u.end - u.start <= chunk_bytes]
    staging = _Staging(device, max(small, default=0), device_buffers or DEVICE_BUFFERS)
    reader = _ReadAhead(units, read_bytes, host_buffers or HOST_BUFFERS, threads or READ_THREADS,
                        pinned=staging.cuda)
    try:
        for unit in units:
            buf = staging.acquire(unit.end - unit.start)
            for offset in range(unit.start, unit.end, read_bytes):
                at = offset - unit.start
                reader.refill_after(staging.copy(buf[at: at + min(read_bytes, unit.end - offset)], reader.take()))
            staging.publish()
            for t in unit.entries:
                yield t.name, _view(buf, unit, t), unit.file
            staging.release()
    finally:
        reader.close(staging.stream)


class _ReadAhead:
    """The units' bytes in pieces of ``read_bytes``, read in order by a pool of threads into a ring of
    (pinned) host buffers, as far ahead as the ring allows."""

    def __init__(self, units: list[_Unit], read_bytes: int, buffers: int, threads: int, pinned: bool):
        self.pieces = [(u, off, min(read_bytes, u.end - off))
                       for u in units for off in range(u.start, u.end, read_bytes)]
        size = max((n for _, _, n in self.pieces), default=0)
        self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
                     for _ in range(max(1, min(buffers, len(self.pieces))))]
        self.views = [memoryview(h.numpy()) for h in self.host]
        self.copied: list = [None] * len(self.host)  # per buffer: the event after which it may be refilled
        self.pinned, self.reads, self.submitted, self.taken = pinned, deque(), 0, 0
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cudaformers-read")
        self.fds: dict[Path, int] = {}
        try:
            for u in units:
                if u.file not in self.fds:
                    self.fds[u.file] = os.open(u.file, os.O_RDONLY)
            for _ in self.host:
                self._submit()
        except BaseException:
            self.close(None)
            raise

    def _submit(self) -> None:
        if self.submitted < len(self.pieces):
            unit, offset, nbytes = self.pieces[self.submitted]
            b = self.submitted % len(self.host)
            self.reads.append(self.pool.submit(_read, self.fds[unit.file], unit, self.views[b][:nbytes], offset,
                                               self.copied[b]))
            self.submitted += 1

    def take(self) -> torch.Tensor:
        """The host buffer holding the next piece (waits for its read; re-raises the reader's error)."""
        self.reads.popleft().result()
        return self.host[self.taken % len(self.host)][:self.pieces[self.taken][2]]

    def refill_after(self, event) -> None:
        """The buffer last taken may be refilled once ``event`` has passed (None: now)."""
        self.copied[self.taken % len(self.host)] = event
        self.taken += 1
        self._submit()

    def close(self, stream) -> None:
        for r in self.reads:
            r.cancel()
        self.pool.shutdown(wait=True)  # no reader may still write into a buffer once we return
        for fd in self.fds.values():
            os.close(fd)
        if self.pinned:
            if stream is not None:
                stream.synchronize()  # copies out of the pinned buffers
            self.host, self.views = [], []
            _release_pinned_memory()


def _read(fd: int, unit: _Unit, buf: memoryview, offset: int, after) -> None:
    """Fill ``buf`` from ``offset`` of the file (in a reader thread: pread releases the GIL)."""
    if after is not None:
        after.synchronize()  # the previous copy out of this buffer has finished
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            at = offset + done
            name = next((t.name for t in unit.entries if t.begin <= at < t.end), "?")
            raise CheckpointError(f"{unit.file}: ends at byte {at}, inside tensor {name!r}; the file is truncated "
                                  "(or was changed while loading): download it again")
        done += n


def _release_pinned_memory() -> None:
    # torch keeps freed pinned blocks for reuse; a few hundred MiB of page-locked memory is not
    # worth keeping for the rest of the process. The call moved between torch versions.
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
