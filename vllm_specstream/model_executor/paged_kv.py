"""Reads the main stream's keys/values back out of vLLM's CPU paged KV cache.

vLLM 0.32's CPU attention stores each layer's cache as ``[num_blocks, num_kv_heads,
block_size, 2 * head_dim]`` where, per (block, head), the first ``block_size * head_dim``
elements hold K and the rest V, in an ISA-specific element order (column-major K for
``vec``, pre-packed AMX tiles for ``amx``, ...). Rather than hard-coding orders, the reader
*probes* the layout once: it writes index-coded keys/values through vLLM's own
``cpu_attn_reshape_and_cache`` into a one-block scratch cache and inverts the permutation.
This is the only module that knows how the CPU cache is laid out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def layer_kv_cache(layer) -> Tensor:
    """A decoder layer's paged KV cache (vLLM keeps it alone or as a one-element list)."""
    cache = layer.self_attn.attn.kv_cache
    return cache[0] if isinstance(cache, list) else cache


def _probe_region(
    write, block_size: int, head_dim: int, num_kv_heads: int, dtype: torch.dtype
) -> Tensor:
    """``[block_size, head_dim]`` flat offset, inside one (block, head) region, of each element.

    ``write(key, value, cache_k, cache_v, slot_mapping)`` stores one block of tokens. Codes are
    written in two passes (low and high digits base 256) because bf16 holds integers <= 256
    exactly.
    """
    n = block_size * head_dim
    codes = torch.arange(n).view(block_size, head_dim)
    found = torch.zeros(2, n, dtype=torch.long)
    for scale in (1, 256):
        value = ((codes // scale) % 256 + 1).to(dtype)
        probe = value[:, None, :].expand(block_size, num_kv_heads, head_dim).contiguous()
        cache = torch.zeros(1, num_kv_heads, 2 * block_size, head_dim, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        write(probe, probe, key_cache, value_cache, torch.arange(block_size, dtype=torch.long))
        regions = cache.view(1, num_kv_heads, 2, n)
        if not bool((regions[0] == regions[0, :1]).all()):
            raise RuntimeError(
                "KV cache layout differs between heads; the paged-KV reader "
                "does not support this vLLM build"
            )
        found += (regions[0, 0].to(torch.long) - 1) * scale  # [2, n]: K region and V region
    # found[r, flat] = code stored at flat offset of region r; invert to code -> flat offset.
    raise_if_not_permutation(found)
    inverse = torch.empty_like(found)
    for r in range(2):
        inverse[r, found[r]] = torch.arange(n)
    return inverse.view(2, block_size, head_dim)


def raise_if_not_permutation(found: Tensor) -> None:
    n = found.shape[-1]
    for r in range(found.shape[0]):
        if not torch.equal(found[r].sort().values, torch.arange(n)):
            raise RuntimeError(
                "probing the CPU KV-cache layout did not give a permutation; "
                "this vLLM build stores K/V in a way the reader does not support"
            )


#: Probed layouts by (kv heads, block size, head dim, dtype, ISA).
_LAYOUTS: dict[tuple, PagedKVLayout] = {}


@dataclass
class PagedKVLayout:
    """Where token ``p`` of a block, dim ``d``, sits inside a (block, head) K or V region."""

    k_offsets: Tensor
    """``[block_size, head_dim]`` flat offsets into the K region."""
    v_offsets: Tensor
    """``[block_size, head_dim]`` flat offsets into the V region."""
    block_size: int
    head_dim: int

    @classmethod
    def of_cache(cls, kv_cache: Tensor, isa: str) -> PagedKVLayout:
        """The layout of a layer's cache ``[num_blocks, num_kv_heads, block_size,
        2 * head_dim]`` written with ``isa``, probed once per process for each shape, dtype
        and ISA (every layer of a model shares one)."""
        _, heads, block_size, two_d = kv_cache.shape
        key = (heads, block_size, two_d // 2, kv_cache.dtype, isa)
        if key not in _LAYOUTS:
            _LAYOUTS[key] = cls.probe(heads, block_size, two_d // 2, kv_cache.dtype, isa)
        return _LAYOUTS[key]

    @classmethod
    def probe(
        cls, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, isa: str
    ) -> PagedKVLayout:
        from vllm import _custom_ops as ops

        def write(key, value, key_cache, value_cache, slot_mapping):
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

        offsets = _probe_region(write, block_size, head_dim, num_kv_heads, dtype)
        return cls(offsets[0], offsets[1], block_size, head_dim)

    def flat_indices(
        self, num_kv_heads: int, block_ids: Tensor, in_block: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Indices into one layer's flattened cache of K and V ``[n, num_kv_heads, head_dim]``
        of the tokens at (``block_ids``, ``in_block``); the same for every layer of a model."""
        region = self.block_size * self.head_dim
        heads = torch.arange(num_kv_heads)
        base = (block_ids.long()[:, None] * num_kv_heads + heads[None, :]) * (2 * region)
        k = base[:, :, None] + self.k_offsets[in_block.long()][:, None, :]
        v = base[:, :, None] + region + self.v_offsets[in_block.long()][:, None, :]
        return k, v

    def position_indices(
        self, num_kv_heads: int, block_table: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """:meth:`flat_indices` of token ``positions`` of requests with block-table rows
        ``block_table``: one row ``[max_blocks]`` with positions ``[n]``, or rows
        ``[R, max_blocks]`` with positions ``[R, P]``."""
        blocks = torch.gather(block_table.long(), -1, positions // self.block_size)
        return self.flat_indices(
            num_kv_heads, blocks.flatten(), (positions % self.block_size).flatten()
        )

    def gather(
        self, kv_cache: Tensor, block_ids: Tensor, in_block: Tensor
    ) -> tuple[Tensor, Tensor]:
        """K and V ``[n, num_kv_heads, head_dim]`` of the tokens at (``block_ids``, ``in_block``)."""
        k_idx, v_idx = self.flat_indices(kv_cache.shape[1], block_ids, in_block)
        return torch.take(kv_cache, k_idx), torch.take(kv_cache, v_idx)
