"""What a measurement ran on, for every benchmark and evaluation record."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.machine()} ({os.cpu_count()} cores)"


def memory_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Memory bandwidth in GB/s: the best of `repeats` timed copies of a `mib` MiB tensor, counting the bytes
    read and written (as STREAM's copy does). Make it larger than the last-level cache, or it times the cache."""
    src = torch.ones(mib * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best / 1e9


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decoding step reads: every weight once (a tied output layer's matrix once), but an
    embedding table, of which a step reads only its rows. int8 layers count their int8 weights and scales."""
    seen, total = set(), 0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    tied = {id(m.weight) for m in model.modules()  # an output layer that shares the embedding's matrix
            if not isinstance(m, torch.nn.Embedding) and id(getattr(m, "weight", None)) in embeddings}
    for module in model.modules():
        int8 = [b for name, b in module.named_buffers(recurse=False) if name in ("weight_int8", "scale")]
        for t in (*module.parameters(recurse=False), *int8):
            if id(t) in seen or (id(t) in embeddings and id(t) not in tied):
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
