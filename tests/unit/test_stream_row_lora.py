"""The stream LoRA's split over tensor-parallel ranks: each rank's rows of ``B`` and columns
of ``A`` put together give the one-rank delta."""

import torch

from vllm_specstream.model_executor.lora.stream_row_lora import merged_rows, qkv_rows


def test_qkv_rows_of_all_ranks_cover_the_merged_output_once_per_kv_replica():
    # 9 query heads and 3 KV heads of 64 over 3 ranks: one KV head each.
    heads, kv_heads, size = 9, 3, 64
    rows = [qkv_rows(r, 3, 1, size, heads, kv_heads, 1) for r in range(3)]
    assert torch.equal(torch.cat(rows).sort().values, torch.arange((heads + 2 * kv_heads) * size))
    # rank 1: query heads 3-5, key head 1, value head 1
    assert rows[1][0] == 3 * size and rows[1][3 * size] == heads * size + size
    assert rows[1][-1] == (heads + kv_heads) * size + 2 * size - 1
    # 4 query heads, 2 KV heads over 4 ranks: each KV head on 2 ranks (replicas)
    rows = [qkv_rows(r, 1, 1, 8, 4, 2, 2) for r in range(4)]
    assert torch.equal(rows[0][8:], rows[1][8:]) and not torch.equal(rows[1][8:], rows[2][8:])


def test_a_sharded_delta_sums_to_the_one_rank_delta():
    torch.manual_seed(0)
    hidden, inter, rank_r, tp = 12, 20, 3, 2
    x = torch.randn(5, hidden)
    a, b = torch.randn(rank_r, hidden), torch.randn(2 * inter, rank_r)  # gate/up merged
    full = x @ a.T @ b.T
    shards = [full[:, merged_rows(r, [inter, inter], tp)] for r in range(tp)]
    local = [x @ a.T @ b[merged_rows(r, [inter, inter], tp)].T for r in range(tp)]
    assert all(torch.allclose(s, t) for s, t in zip(shards, local))
    # row-parallel (down): each rank reads a slice of the input; A x summed over ranks
    a2, b2 = torch.randn(rank_r, inter), torch.randn(hidden, rank_r)
    h = torch.randn(5, inter)
    width = inter // tp
    summed = sum(
        h[:, r * width : (r + 1) * width] @ a2[:, r * width : (r + 1) * width].T for r in range(tp)
    )
    assert torch.allclose(summed @ b2.T, h @ a2.T @ b2.T, atol=1e-5)
