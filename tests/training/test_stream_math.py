"""Batched multi-stream attention equals a naive per-anchor implementation; masks hold."""

import pytest
import torch

from vllm_specstream.streams.stream_math import (
    anchor_main_mask,
    init_streams,
    joint_attention_mask,
    joint_stream_attention,
    multi_stream_attention,
    stream_position_ids,
    stream_targets,
)


def naive_msa(q, k_main, v_main, k_s, v_s, anchor_pos, scale):
    """Loop over batch, head, anchor and stream; explicit key lists, plain softmax."""
    b, h, a, g, d = q.shape
    rep = h // k_main.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kv = hi // rep
            for ai in range(a):
                t = int(anchor_pos[bi, ai])
                for j in range(g):
                    keys = [k_main[bi, kv, p] for p in range(t + 1)] + [
                        k_s[bi, kv, ai, i] for i in range(j + 1)
                    ]
                    vals = [v_main[bi, kv, p] for p in range(t + 1)] + [
                        v_s[bi, kv, ai, i] for i in range(j + 1)
                    ]
                    scores = torch.stack([q[bi, hi, ai, j] @ kk for kk in keys]) * scale
                    w = torch.softmax(scores, dim=0)
                    out[bi, hi, ai, j] = sum(wi * vi for wi, vi in zip(w, vals))
    return out


def random_msa_inputs(seed, b, h, kv, a, g, d, p):
    """Queries ``[b, h, a, g, d]``, main keys/values ``[b, kv, p, d]``, stream keys/values
    ``[b, kv, a, g, d]``."""
    torch.manual_seed(seed)
    q = torch.randn(b, h, a, g, d)
    return q, *torch.randn(2, b, kv, p, d), *torch.randn(2, b, kv, a, g, d)


def test_batched_msa_equals_naive():
    b, h, kv, a, g, d, p = 2, 4, 2, 3, 3, 8, 7
    q, k_main, v_main, k_s, v_s = random_msa_inputs(0, b, h, kv, a, g, d, p)
    anchor_pos = torch.tensor([[0, 3, 6], [2, 2, 5]])
    mask = anchor_main_mask(anchor_pos, torch.arange(p))
    got = multi_stream_attention(q, k_main, v_main, k_s, v_s, mask, 0.3)
    want = naive_msa(q, k_main, v_main, k_s, v_s, anchor_pos, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_joint_attention_equals_naive_and_keeps_padding_anchors_finite():
    """The inference form (one fused attention over [main keys, stream keys], queries
    flattened anchor-major) equals the per-anchor reference; a padding anchor (sees no main
    key) still gets finite outputs."""
    b, h, kv, a, g, d, p = 2, 6, 2, 3, 4, 8, 9
    q, k_main, v_main, k_s, v_s = random_msa_inputs(2, b, h, kv, a, g, d, p)
    anchor_pos = torch.tensor([[1, 4, 8], [0, 6, 7]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    main_mask = anchor_main_mask(anchor_pos, torch.arange(p)) & valid[..., None]
    mask = joint_attention_mask(main_mask, g)
    assert mask.shape == (b, a * g, p + a * g)
    got = joint_stream_attention(
        q.reshape(b, h, a * g, d),
        k_main,
        v_main,
        k_s.reshape(b, kv, a * g, d),
        v_s.reshape(b, kv, a * g, d),
        mask,
        0.3,
    ).reshape(b, h, a, g, d)
    want = naive_msa(q, k_main, v_main, k_s, v_s, anchor_pos, 0.3)
    torch.testing.assert_close(
        got[valid[:, None, :].expand(b, h, a)],
        want[valid[:, None, :].expand(b, h, a)],
        atol=1e-5,
        rtol=1e-5,
    )
    assert torch.isfinite(got).all()


def test_msa_ignores_future_main_keys_and_later_streams():
    torch.manual_seed(1)
    b, h, kv, a, g, d, p = 1, 2, 1, 2, 4, 8, 10
    q = torch.randn(b, h, a, g, d)
    k_main, v_main = torch.randn(b, kv, p, d), torch.randn(b, kv, p, d)
    k_s, v_s = torch.randn(b, kv, a, g, d), torch.randn(b, kv, a, g, d)
    anchor_pos = torch.tensor([[4, 7]])
    mask = anchor_main_mask(anchor_pos, torch.arange(p))
    base = multi_stream_attention(q, k_main, v_main, k_s, v_s, mask, 0.5)
    # Change main keys/values after anchor 0's position: anchor 0 must not move.
    k2, v2 = k_main.clone(), v_main.clone()
    k2[:, :, 5:] += 3.0
    v2[:, :, 5:] -= 2.0
    moved = multi_stream_attention(q, k2, v2, k_s, v_s, mask, 0.5)
    torch.testing.assert_close(moved[:, :, 0], base[:, :, 0])
    assert not torch.allclose(moved[:, :, 1], base[:, :, 1])
    # Change stream 3's keys/values: streams 1..2 must not move, stream 3 and 4 must.
    ks2, vs2 = k_s.clone(), v_s.clone()
    ks2[..., 2, :] += 3.0
    vs2[..., 2, :] += 3.0
    moved = multi_stream_attention(q, k_main, v_main, ks2, vs2, mask, 0.5)
    torch.testing.assert_close(moved[..., :2, :], base[..., :2, :])
    assert not torch.allclose(moved[..., 2:, :], base[..., 2:, :])


def test_stream_positions():
    anchors = torch.tensor([[0, 5]])
    assert stream_position_ids(anchors, 3, "shifted").tolist() == [[[1, 2, 3], [6, 7, 8]]]
    assert stream_position_ids(anchors, 3, "anchor").tolist() == [[[0, 0, 0], [5, 5, 5]]]
    with pytest.raises(ValueError, match="stream_position"):
        stream_position_ids(anchors, 3, "middle")


def test_init_streams_identity_and_adapter():
    m = torch.randn(2, 5, 8)
    p = torch.randn(3, 8)
    s = init_streams(m, p)
    assert s.shape == (2, 5, 3, 8)
    torch.testing.assert_close(s[:, :, 1], m + p[1])
    a, b0 = torch.randn(2, 8), torch.zeros(8, 2)
    torch.testing.assert_close(init_streams(m, p, a, b0), s)  # B = 0: f is the identity


def test_stream_targets():
    ids = torch.arange(10, 20)[None]
    valid = torch.tensor([[False] * 4 + [True] * 6])
    targets, ok = stream_targets(ids, valid, torch.tensor([[2, 7, -1]]), 2)
    # anchor 2: stream 1 -> x[4], stream 2 -> x[5]; anchor 7: x[9], x[10] (out of range)
    assert targets[0, 0].tolist() == [14, 15] and ok[0, 0].tolist() == [True, True]
    assert targets[0, 1, 0].item() == 19 and ok[0, 1].tolist() == [True, False]
    assert ok[0, 2].tolist() == [False, False]
