"""What the GPU bench (cuda.py, cuda_sessions.py) measures a device with: timed calls with the device drained, one
launch's cost, the copy bandwidth, and the kernels a call launches (CUDA's profiler). Each takes a device, so that the
bench's plumbing runs on a CPU too (time.perf_counter's times; kernels: None)."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device="cuda") -> None:
    """Wait for the device's queued kernels (a CPU has none to wait for)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def device_name(device="cuda") -> str:
    return torch.cuda.get_device_name(device) if is_cuda(device) else (platform.processor() or platform.machine()
                                                                       or "cpu")


def synchronized_ms(run, repeats: int = 30, device="cuda") -> float:
    """Median ms of run() with the device drained before and after each call (time.perf_counter's)."""
    times = []
    for _ in range(repeats + 3):
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1e3


def launch_us(count: int = 3000, device="cuda") -> float:
    """Microseconds per kernel launched back to back from Python (a one-element add; on a CPU, what dispatching
    one costs)."""
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    synchronize(device)
    return (time.perf_counter() - started) / count * 1e6


def copy_bandwidth(megabytes: int | None = None, device="cuda") -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and what it writes (1 GB on a GPU,
    256 MB in host memory)."""
    megabytes = megabytes or (1024 if is_cuda(device) else 256)
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = synchronized_ms(lambda: target.copy_(source), repeats=10, device=device)
    return 2 * source.numel() / (ms / 1e3)


def device_events(run) -> list:
    """The profiler's GPU events of one call of run() (after one call to warm up; a CUDA graph's replay shows the
    kernels inside it)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def kernels(run, device="cuda") -> int | None:
    """CUDA kernels one call of run() launches (copies and fills aside); None off CUDA (nothing counts them)."""
    if not is_cuda(device):
        return None
    return sum(1 for event in device_events(run)
               if "memcpy" not in event.name.lower() and "memset" not in event.name.lower())


def kernel_profile(run, top: int = 12) -> list[dict]:
    """Where one call of run() spends the GPU's time: the kernels that take most, with their count per call."""
    totals: dict[str, list] = {}
    for event in device_events(run):
        entry = totals.setdefault(event.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time_total
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"kernel": name, "count": count, "us": round(us, 1)} for name, (count, us) in ranked]
