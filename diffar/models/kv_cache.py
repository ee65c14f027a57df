"""Preallocated key/value cache, one module per attention layer (as in gpt-fast).

Slots are shared across the batch: slot s of every row was written by the same forward call.
Left padding and per-row positions are the decoder's business (see diffar/decoding/ar.py);
the cache only stores, returns and compacts. Rolling back is free: later calls overwrite from `start`.
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv_head: int, max_len: int, head_dim: int, dtype: torch.dtype):
        """n_kv_head: the key/value heads, fewer than the query heads under grouped-query attention."""
        super().__init__()
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, H, T, D) at slots [start, start+T); return the filled prefix [0, start+T)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} slots")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def compact(self, keep: torch.Tensor) -> None:
        """Gather slots keep (B, w), row by row and in the given order, into slots [0, w): how a
        draft-and-verify decoder drops its rejected slots without re-running the kept tokens."""
        index = keep.to(self.k.device)[:, None, :, None].expand(-1, self.k.shape[1], -1, self.k.shape[3])
        w = keep.shape[1]
        self.k[:, :, :w], self.v[:, :, :w] = self.k.gather(2, index), self.v.gather(2, index)
