"""The paged-KV reader returns exactly what vLLM's CPU cache kernel stored (any layout)."""

import pytest
import torch

from vllm_specstream.model_executor.paged_kv import PagedKVLayout


def isa_for(dtype, block_size, head_dim):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size,head_dim", [(128, 64), (16, 64), (32, 128)])
def test_gather_returns_what_the_kernel_stored(dtype, block_size, head_dim):
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    heads, num_blocks, n = 3, 6, 40
    isa = isa_for(dtype, block_size, head_dim)
    layout = PagedKVLayout.probe(heads, block_size, head_dim, dtype, isa)
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(
        2, dim=2
    )
    slots = torch.randperm(num_blocks * block_size)[:n]
    k = torch.randn(n, heads, head_dim).to(dtype)
    v = torch.randn(n, heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    got_k, got_v = layout.gather(kv_cache, slots // block_size, slots % block_size)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
