"""Tree attention: the pure node-row attention, and the CPU backend against vLLM's own kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends import cpu_attn  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_specstream.model_executor.trees import attention as tree_attention  # noqa: E402
from vllm_specstream.model_executor.trees.attention import (  # noqa: E402
    TreeCPUAttentionBackend,
    TreeCPUAttentionImpl,
    TreeRequest,
    TreeStep,
    current_tree_step,
    register_tree_attention,
    set_tree_step,
    tree_attention_problem,
    tree_rows_attention,
)

H, H_KV, D, BLOCK = 4, 2, 64, 32
BRANCHY = (-1, 0, -1, 1, 0, 2)
TREE = (-1, 0, 1, -1, 0, 3)  # top-1 chain 0-1-2, then a root sibling (3), 0's second child (4)


def _ancestors_or_self(i: int, parents) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible, scale: float):
    """``q`` ``[Hq, D]`` attending to rows ``visible`` of ``k``/``v`` ``[L, Hkv, D]``, head
    by head with an explicit softmax."""
    group = q.shape[0] // k.shape[1]
    rows = torch.tensor(sorted(visible))
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        kh, vh = k[rows, h // group].double(), v[rows, h // group].double()
        w = torch.softmax(kh @ q[h].double() * scale, dim=0)
        out[h] = (w[:, None] * vh).sum(0).to(q.dtype)
    return out


def _dense_tree(q_nodes, k_seq, v_seq, c: int, parents, scale: float) -> torch.Tensor:
    """Reference for node rows: node ``i`` sees positions ``0..c`` (prefix and root) and its
    ancestors-or-self at ``c + 1 + j``."""
    return torch.stack(
        [
            _dense(
                q_nodes[i],
                k_seq,
                v_seq,
                list(range(c + 1)) + [c + 1 + j for j in _ancestors_or_self(i, parents)],
                scale,
            )
            for i in range(len(parents))
        ]
    )


# -- the pure function --------------------------------------------------------------------


@pytest.mark.parametrize("h_q,h_kv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("c", [0, 9])
def test_tree_rows_attention_is_the_dense_tree_attention(h_q, h_kv, c):
    torch.manual_seed(0)
    n = len(BRANCHY)
    q = torch.randn(n, h_q, 16)
    k, v = torch.randn(c + 1 + n, h_kv, 16), torch.randn(c + 1 + n, h_kv, 16)
    got = tree_rows_attention(q, k[:c], v[:c], k[c:], v[c:], BRANCHY, 0.3)
    assert got.shape == (n, h_q, 16) and got.dtype == q.dtype
    want = _dense_tree(q, k, v, c, BRANCHY, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_chain_is_causal_attention():
    torch.manual_seed(1)
    c, n = 7, 4
    q = torch.randn(n, 4, 16)
    k, v = torch.randn(c + 1 + n, 2, 16), torch.randn(c + 1 + n, 2, 16)
    got = tree_rows_attention(q, k[:c], v[:c], k[c:], v[c:], (-1, 0, 1, 2), 0.25)
    causal = torch.stack([_dense(q[i], k, v, range(c + 2 + i), 0.25) for i in range(n)])
    torch.testing.assert_close(got, causal, atol=1e-5, rtol=1e-5)


def test_tree_rows_attention_keeps_the_query_dtype():
    q = torch.randn(2, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    got = tree_rows_attention(q, k[:1], k[:1], k[1:], k[1:], (-1, -1), 0.25)
    assert got.dtype == torch.bfloat16


# -- the backend against vLLM's CPU kernel ------------------------------------------------


def _config():
    """The few fields of a ``VllmConfig`` the CPU impl and metadata builder read."""
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32, get_num_attention_heads=lambda _: H),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def _impl(cls, **kw):
    with set_current_vllm_config(_config()):
        return cls(H, D, D**-0.5, H_KV, None, kw.pop("sliding_window", None), "auto", **kw)


class Batch:
    """Three requests in one step: a 5-token prefill, a tree of ``len(TREE)`` nodes over 40
    cached tokens (two blocks), a plain decode over 20 cached tokens. The earlier steps'
    keys/values and this step's are written with vLLM's kernel, as the runner would."""

    cached = (0, 40, 20)
    q_lens = (5, 1 + len(TREE), 1)

    def __init__(self) -> None:
        torch.manual_seed(2)
        self.isa = cpu_attn._get_attn_isa(torch.float32, BLOCK, D, "auto")
        self.layer = SimpleNamespace(isa=self.isa, _k_scale_float=1.0, _v_scale_float=1.0)
        self.stock = _impl(cpu_attn.CPUAttentionBackendImpl)
        self.tree = _impl(TreeCPUAttentionImpl)
        self.seq_lens = [c + q for c, q in zip(self.cached, self.q_lens)]
        self.block_table = torch.tensor([[6, 0], [3, 7], [1, 2]], dtype=torch.int32)
        self.kv_cache = torch.zeros(8, H_KV, BLOCK, 2 * D)
        self.k = [torch.randn(s, H_KV, D) for s in self.seq_lens]
        self.v = [torch.randn(s, H_KV, D) for s in self.seq_lens]
        for r, c in enumerate(self.cached):
            if c:
                self.write(self.k[r][:c], self.v[r][:c], self.slots(r, range(c)))
        step = [range(c, s) for c, s in zip(self.cached, self.seq_lens)]
        self.key = torch.cat([self.k[r][list(p)] for r, p in enumerate(step)])
        self.value = torch.cat([self.v[r][list(p)] for r, p in enumerate(step)])
        slot_mapping = torch.cat([self.slots(r, p) for r, p in enumerate(step)])
        self.write(self.key, self.value, slot_mapping)
        self.query = torch.randn(self.key.shape[0], H, D)
        self.metadata = self.build_metadata(slot_mapping)

    def slots(self, r: int, positions) -> torch.Tensor:
        return torch.tensor(
            [int(self.block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]
        )

    def write(self, key, value, slot_mapping) -> None:
        self.stock.do_kv_cache_update(self.layer, key, value, self.kv_cache, slot_mapping)

    def build_metadata(self, slot_mapping):
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=H_KV, head_size=D, dtype=torch.float32
        )
        builder = cpu_attn.CPUAttentionMetadataBuilder(spec, [], _config(), torch.device("cpu"))
        qsl = torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            num_reqs=3,
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens),
            block_table_tensor=self.block_table,
            slot_mapping=slot_mapping,
        )
        return builder.build(0, common)

    def run(self, impl, flat: bool = False) -> torch.Tensor:
        out = torch.full_like(self.query, float("nan"))
        view = out.view(out.shape[0], H * D) if flat else out
        impl.forward(
            self.layer, self.query, self.key, self.value, self.kv_cache, self.metadata, view
        )
        return out

    def node_rows_reference(self) -> torch.Tensor:
        start, c = self.q_lens[0], self.cached[1]
        q_nodes = self.query[start + 1 : start + 1 + len(TREE)]
        return _dense_tree(q_nodes, self.k[1], self.v[1], c, TREE, D**-0.5)


@pytest.fixture(scope="module")
def batch() -> Batch:
    return Batch()


@pytest.fixture(autouse=True)
def _no_tree_step():
    set_tree_step(None)
    yield
    set_tree_step(None)


def _run_with_trees(batch: Batch, impl, step: TreeStep, flat: bool = False) -> torch.Tensor:
    set_tree_step(step)
    try:
        return batch.run(impl, flat)
    finally:
        set_tree_step(None)


ROOT, NODES = 5, slice(6, 6 + len(TREE))  # the tree request's rows in the batch


def test_backend_redoes_only_the_node_rows(batch):
    want = batch.run(batch.stock)
    # the decode request listed with a tree too: query length 1, nothing to redo
    got = _run_with_trees(
        batch, batch.tree, TreeStep((TreeRequest(1, TREE), TreeRequest(2, (-1, 0))))
    )
    assert torch.equal(got[:ROOT], want[:ROOT])  # the prefill request
    assert torch.equal(got[ROOT], want[ROOT])  # the root
    assert torch.equal(got[NODES.stop :], want[NODES.stop :])  # the decode request
    torch.testing.assert_close(got[NODES], batch.node_rows_reference(), atol=1e-4, rtol=1e-4)
    # the top-1 chain's nodes see exactly the rows before them: the stock kernel agrees
    torch.testing.assert_close(got[6:9], want[6:9], atol=1e-5, rtol=1e-5)
    # a root sibling listed after the chain: the causal stock row also saw the chain
    assert not torch.allclose(got[9], want[9], atol=1e-3)


def test_backend_takes_a_flat_output_and_a_cut_tree(batch):
    full = _run_with_trees(batch, batch.tree, TreeStep((TreeRequest(1, TREE),)))
    flat = _run_with_trees(batch, batch.tree, TreeStep((TreeRequest(1, TREE),)), flat=True)
    assert torch.equal(flat, full)
    # parents beyond the scheduled nodes (the scheduler cut the drafts) are ignored
    longer = TreeStep((TreeRequest(1, (*TREE, 4, 5)),))
    assert torch.equal(_run_with_trees(batch, batch.tree, longer), full)
    # a layer sharing another layer's cache gets no key/value: the step is read from the cache
    set_tree_step(TreeStep((TreeRequest(1, TREE),)))
    shared = torch.full_like(batch.query, float("nan"))
    batch.tree.forward(batch.layer, batch.query, None, None, batch.kv_cache, batch.metadata, shared)
    assert torch.equal(shared, full)


def test_backend_redoes_trees_of_several_sizes_in_one_batch(batch):
    # Request 0's five rows read as a root and a 4-node tree over no cached tokens, beside
    # request 1's tree over 40: the padded batch (prefix, nodes) gives each its own rows.
    small = (-1, 0, -1, 2)
    step = TreeStep((TreeRequest(0, small), TreeRequest(1, TREE)))
    got = _run_with_trees(batch, batch.tree, step)
    want_small = _dense_tree(batch.query[1:5], batch.k[0], batch.v[0], 0, small, D**-0.5)
    torch.testing.assert_close(got[1:5], want_small, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[NODES], batch.node_rows_reference(), atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0], batch.run(batch.stock)[0])  # request 0's root


def test_backend_is_vllms_without_trees(batch):
    want = batch.run(batch.stock)
    assert current_tree_step() is None
    assert torch.equal(batch.run(batch.tree), want)
    assert torch.equal(_run_with_trees(batch, batch.tree, TreeStep(())), want)
    set_tree_step(TreeStep((TreeRequest(1, TREE),)))
    out = torch.zeros_like(batch.query)  # warm-up: no metadata, nothing written
    batch.tree.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, None, out)
    assert not out.any()


def test_the_node_row_check_fails_if_the_override_does_nothing(batch, monkeypatch):
    monkeypatch.setattr(tree_attention, "redo_tree_rows", lambda *args: None)
    got = _run_with_trees(batch, batch.tree, TreeStep((TreeRequest(1, TREE),)))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[NODES], batch.node_rows_reference(), atol=1e-4, rtol=1e-4)


def test_a_layer_the_tree_path_cannot_serve_raises(batch):
    impl = _impl(TreeCPUAttentionImpl, sliding_window=16)
    step = TreeStep((TreeRequest(1, TREE),))
    args = (batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata)
    with pytest.raises(RuntimeError, match="sliding-window"):
        tree_attention.redo_tree_rows(impl, *args, torch.empty_like(batch.query), step)


# -- registration and refusals -------------------------------------------------------------


def test_register_makes_vllm_build_the_tree_backend():
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    backend = AttentionBackendEnum.CPU_ATTN
    saved = _ATTN_OVERRIDES.get(backend)
    try:
        register_tree_attention()
        register_tree_attention()  # idempotent
        assert backend.get_path() == f"{tree_attention.__name__}.TreeCPUAttentionBackend"
        assert backend.get_class() is TreeCPUAttentionBackend
        assert TreeCPUAttentionBackend.get_name() == "CPU_ATTN"
        assert TreeCPUAttentionBackend.get_impl_cls() is TreeCPUAttentionImpl
        assert TreeCPUAttentionBackend.get_builder_cls() is cpu_attn.CPUAttentionMetadataBuilder
    finally:
        if saved is None:
            _ATTN_OVERRIDES.pop(backend, None)
        else:
            _ATTN_OVERRIDES[backend] = saved


def test_tree_attention_problem():
    assert tree_attention_problem(_impl(TreeCPUAttentionImpl)) is None
    assert tree_attention_problem(_impl(TreeCPUAttentionImpl, sliding_window=256)) == (
        "sliding-window attention"
    )
    assert tree_attention_problem(_impl(TreeCPUAttentionImpl, logits_soft_cap=30.0)) == (
        "logit soft-capping"
    )
    assert tree_attention_problem(_impl(TreeCPUAttentionImpl, sinks=torch.zeros(H))) == (
        "attention sinks"
    )
    assert tree_attention_problem(_impl(TreeCPUAttentionImpl, attn_type="encoder_only")) == (
        "encoder attention"
    )
    base = vars(_impl(TreeCPUAttentionImpl))
    assert tree_attention_problem(SimpleNamespace(**{**base, "alibi_slopes": [1.0]})) == "ALiBi"
    assert tree_attention_problem(SimpleNamespace(**{**base, "kv_cache_dtype": "fp8"})) == (
        "an fp8 KV cache"
    )
