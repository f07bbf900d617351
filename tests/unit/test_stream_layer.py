"""The stream layer written once: its requests, their order, and the attention barrier."""

from dataclasses import dataclass, field

import torch

from vllm_specstream.streams.stream_layer import (
    ATTEND,
    PROJECTIONS,
    STAGES,
    layer_forward,
    run_layer,
    stream_layer,
)

H, HEADS, D = 8, 2, 4


@dataclass
class RecordingOps:
    """Simple stand-ins for the layer's steps that record when they run."""

    calls: list[str] = field(default_factory=list)

    def input_norm(self, s):
        self.calls.append("input_norm")
        return s * 2.0

    def rotate(self, qkv):
        self.calls.append("rotate")
        return qkv.split([H, H, H], dim=-1)

    def attend(self, q, k, v):
        self.calls.append("attend")
        return q * k + v

    def post_norm(self, s):
        self.calls.append("post_norm")
        return s - 1.0

    def act(self, gate_up):
        self.calls.append("act")
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


@dataclass
class Linears:
    qkv: torch.nn.Linear
    o: torch.nn.Linear
    gate_up: torch.nn.Linear
    down: torch.nn.Linear


def linears() -> Linears:
    torch.manual_seed(0)
    lin = torch.nn.Linear
    return Linears(lin(H, 3 * H), lin(H, H), lin(H, 4 * H), lin(2 * H, H))


def written_out(s, ops, mm):
    """The layer as one would write it inline."""
    q, k, v = ops.rotate(mm.qkv(ops.input_norm(s)))
    s = s + mm.o(ops.attend(q, k, v))
    return s + mm.down(ops.act(mm.gate_up(ops.post_norm(s))))


def test_stages_are_the_projections_and_the_attention_barrier():
    assert set(PROJECTIONS) | {ATTEND} == set(STAGES)
    assert PROJECTIONS == ("qkv", "o", "gate_up", "down")


def test_requests_come_in_stage_order_with_their_rows():
    s, mm, ops = torch.randn(5, H), linears(), RecordingOps()
    layer = stream_layer(s, ops)
    seen = []
    answer = None
    try:
        while True:
            stage, rows = layer.send(answer)
            seen.append(stage)
            assert (rows is None) == (stage == ATTEND)
            answer = None if rows is None else getattr(mm, stage)(rows)
    except StopIteration:
        pass
    assert tuple(seen) == STAGES
    assert ops.calls == ["input_norm", "rotate", "attend", "post_norm", "act"]


def test_attention_runs_only_after_the_barrier_is_answered():
    """The fused pass answers ``attend`` when o_proj is entered, after vLLM has written the
    step's keys: nothing may read them before."""
    s, mm, ops = torch.randn(5, H), linears(), RecordingOps()
    layer = stream_layer(s, ops)
    stage, rows = next(layer)
    assert stage == "qkv"
    assert layer.send(mm.qkv(rows)) == (ATTEND, None)
    assert "attend" not in ops.calls
    stage, _ = layer.send(None)
    assert stage == "o" and ops.calls[-1] == "attend"


def test_run_layer_equals_the_layer_written_out():
    s, mm = torch.randn(3, 4, H), linears()
    with torch.no_grad():
        got = run_layer(stream_layer(s, RecordingOps()), mm)
        want = written_out(s, RecordingOps(), mm)
    assert torch.equal(got, want)


def test_the_straight_layer_equals_the_generator():
    """The compiled pass's straight layer and the generator the fused pass and training
    drive must not drift apart."""
    s, mm = torch.randn(3, 4, H), linears()
    with torch.no_grad():
        got = layer_forward(s, RecordingOps(), mm)
        want = run_layer(stream_layer(s, RecordingOps()), mm)
    assert torch.equal(got, want)


def test_gradients_flow_through_the_generator():
    s, mm = torch.randn(2, H, requires_grad=True), linears()
    run_layer(stream_layer(s, RecordingOps()), mm).square().sum().backward()
    got = s.grad.clone(), mm.qkv.weight.grad.clone()
    s.grad = None
    mm.qkv.weight.grad = None
    written_out(s, RecordingOps(), mm).square().sum().backward()
    assert torch.equal(got[0], s.grad) and torch.equal(got[1], mm.qkv.weight.grad)
