"""The paged-KV reader returns exactly what vLLM's CPU cache kernel stored (any layout)."""

import pytest
import torch

from vllm_specstream.model_executor.paged_kv import PagedKVLayout


def isa_for(dtype, block_size, head_dim):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size,head_dim", [(128, 64), (16, 64), (32, 128)])
def test_gather_blocks_returns_every_slot_of_the_blocks_in_order(dtype, block_size, head_dim):
    """Whole-block reads (the stream pass's path) equal the element-wise reader, slot by
    slot, for two requests with their own block lists."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    heads, num_blocks = 2, 7
    isa = isa_for(dtype, block_size, head_dim)
    layout = PagedKVLayout.probe(heads, block_size, head_dim, dtype, isa)
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(
        2, dim=2
    )
    slots = torch.arange(num_blocks * block_size)
    k = torch.randn(len(slots), heads, head_dim).to(dtype)
    v = torch.randn(len(slots), heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    block_ids = torch.tensor([[5, 1, 3], [0, 6, 2]])
    got_k, got_v = layout.gather_blocks(kv_cache, block_ids)
    for r in range(2):
        want = torch.cat([slots[b * block_size : (b + 1) * block_size] for b in block_ids[r]])
        assert torch.equal(got_k[r], k[want].transpose(0, 1))
        assert torch.equal(got_v[r], v[want].transpose(0, 1))
