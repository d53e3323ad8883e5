"""Where models and tensors run: choosing the device, naming it, and reading the clock on it.

CUDA runs asynchronously: a wall-clock reading taken while kernels are still queued times their launch, not their
work, so every timing in dspark-hf reads [`clock`], which waits for it first.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections import defaultdict

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None): the CUDA GPU when torch sees one, else the CPU; anything else as ``torch.device``.
    Raises ValueError, saying what to pass instead, for a device torch cannot use here."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={str(device)!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from error
    if device.type not in ("cpu", "cuda"):  # what dspark-hf is built and tested for
        raise ValueError(f"device={str(device)!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but torch sees no CUDA GPU here (a CPU-only build, or no driver): "
                         "use 'cpu', or 'auto' to take a GPU only when there is one.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, but torch sees {torch.cuda.device_count()} CUDA GPU(s): use an "
                         f"index below {torch.cuda.device_count()}.")
    return indexed(device)  # what model.device will report, so devices compare equal


def indexed(device: str | torch.device) -> torch.device:
    """`device` with its index: a CUDA device named without one ("cuda", as accelerate reports a single process's
    GPU) is the current GPU. Some torch.cuda calls refuse a device without an index
    (``set_per_process_memory_fraction``: "Expected a torch.device with a specified index")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def computes_bfloat16_natively(device: str | torch.device) -> bool:
    """Whether `device` has bfloat16 matrix units: a CUDA GPU that supports bf16, or a CPU with AVX512-BF16 or AMX
    (where a bfloat16 matmul runs several times as fast as a float32 one)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":  # private helpers, present in torch >= 2.1; absent means "do not assume"
        return any(getattr(torch.cpu, name, lambda: False)()
                   for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def clock(device: torch.device | str, stream: torch.cuda.Stream | None = None) -> float:
    """time.perf_counter() once the work queued on `device` is done (only that on `stream`, a CUDA stream of it,
    where given): differences of two readings time that work."""
    if stream is not None:
        stream.synchronize()
    else:
        synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Seconds spent in named phases of work queued on a device, timed without waiting for it: CUDA events recorded
    on the current stream on a GPU, read once (`totals`, which waits for them) when the work is done; the wall clock
    elsewhere. `enabled=False` times nothing (phases cost no more than a `with`)."""

    def __init__(self, device: torch.device | str, enabled: bool = True):
        self.device, self.enabled = torch.device(device), enabled
        self._events: dict[str, list] = defaultdict(list)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
            return
        start = time.perf_counter()
        yield
        self._seconds[name] += time.perf_counter() - start

    def totals(self, names=()) -> dict[str, float]:
        """Seconds by phase, `names` included at 0 if never timed (waits for the events on a GPU)."""
        if self._events:
            torch.cuda.synchronize(self.device)
        seconds = dict.fromkeys(names, 0.0)
        seconds.update(self._seconds)
        for name, pairs in self._events.items():
            seconds[name] = seconds.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1000
        return seconds


class GpuMonitor:
    """How busy a run kept its GPU: utilisation read every `every` seconds (NVML, through torch.cuda.utilization)
    and the peak memory torch allocated, against the card's. Off CUDA it reads nothing and reports None. A next run
    reads it to size its batch: a GPU that sat idle part of the time, or used a small share of its memory, takes a
    larger one."""

    def __init__(self, device: torch.device, every: float = 1.0, now=time.perf_counter):
        self.device, self.every, self.now = torch.device(device), every, now
        self.readings: list[float] = []
        self.last = None
        self.unreadable = None  # why utilisation could not be read (no NVML binding, say)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def sample(self) -> None:
        if self.device.type != "cuda" or self.unreadable is not None:
            return
        now = self.now()
        if self.last is not None and now - self.last < self.every:
            return
        self.last = now
        try:
            self.readings.append(float(torch.cuda.utilization(self.device)))
        except Exception as error:  # NVML missing or refused: the memory figures still stand
            self.unreadable = f"{type(error).__name__}: {error}"

    def report(self) -> dict | None:
        if self.device.type != "cuda":
            return None
        gib = 2 ** 30
        report = {"device": torch.cuda.get_device_name(self.device),
                  "peak_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / gib, 2),
                  "memory_gib": round(torch.cuda.get_device_properties(self.device).total_memory / gib, 2),
                  "utilisation_readings": len(self.readings),
                  "utilisation_mean": round(sum(self.readings) / len(self.readings), 1) if self.readings else None}
        if self.unreadable:
            report["utilisation_unreadable"] = self.unreadable
        return report

    def line(self) -> str | None:
        """The report in one line for a log, or None off CUDA."""
        r = self.report()
        if r is None:
            return None
        busy = (f"utilisation {r['utilisation_mean']:.0f}% on average over {r['utilisation_readings']} readings"
                if r["utilisation_mean"] is not None else f"utilisation not read ({r.get('utilisation_unreadable')})")
        return f"GPU {r['device']}: {busy}, peak memory {r['peak_memory_gib']:.1f} of {r['memory_gib']:.1f} GiB"
