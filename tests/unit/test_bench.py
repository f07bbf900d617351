"""`specstream bench` without engines: configs per method, the summary math, the outputs."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_specstream.bench.bench import (
    OMP_BIND,
    BenchConfig,
    additional_config_for,
    combine_rounds,
    engine_env,
    env_setting,
    extra_params,
    groups,
    markdown_table,
    plot,
    request_timing,
    speculative_config_for,
    steps_per_method,
    summarize,
)


@pytest.fixture
def dirs(tmp_path):
    ckpt, medusa = tmp_path / "ckpt", tmp_path / "medusa"
    ckpt.mkdir()
    medusa.mkdir()
    (ckpt / "config.json").write_text("{}")
    save_file(
        {"specstream.stream_embeddings": torch.zeros(4, 8)}, str(ckpt / "specstream.safetensors")
    )
    (medusa / "config.json").write_text(json.dumps({"num_heads": 3}))
    save_file(
        {"blocks.0.layers.0.weight": torch.zeros(8, 8), "lm_head.weight": torch.zeros(50, 8)},
        str(medusa / "model.safetensors"),
    )
    return ckpt, medusa


def test_config_errors_name_the_flag(dirs, tmp_path):
    ckpt, medusa = dirs
    with pytest.raises(ValueError, match="--medusa"):
        BenchConfig(checkpoint=str(ckpt), methods=("medusa",))
    with pytest.raises(ValueError, match="--methods: unknown \\['eagle'\\]"):
        BenchConfig(checkpoint=str(ckpt), methods=("eagle",))
    with pytest.raises(ValueError, match="no config.json"):
        BenchConfig(checkpoint=str(tmp_path / "nowhere"), methods=("plain",))
    cfg = BenchConfig(checkpoint=str(ckpt), methods=("specstream",))
    assert cfg.methods == ("plain", "specstream")  # plain is the reference, always run


def test_speculative_configs_and_extra_params(dirs):
    ckpt, medusa = dirs
    cfg = BenchConfig(checkpoint=str(ckpt), medusa=str(medusa), num_speculative_tokens=4)
    assert speculative_config_for("plain", cfg) is None
    assert speculative_config_for("plain-control", cfg) is None
    assert extra_params("plain-control", cfg) == 0
    assert speculative_config_for("ngram", cfg)["prompt_lookup_max"] == 4
    assert speculative_config_for("medusa", cfg)["num_speculative_tokens"] == 3  # 3 heads
    assert speculative_config_for("suffix", cfg) == {
        "method": "suffix",
        "num_speculative_tokens": 4,
    }
    assert speculative_config_for("specstream", cfg)["method"] == "custom_class"
    fixed = speculative_config_for("specstream-fixed", cfg)
    assert fixed["num_speculative_tokens_per_batch_size"] == [(1, 1 << 16, 4)]
    assert extra_params("specstream-fixed", cfg) == 32
    assert extra_params("specstream", cfg) == 32
    assert extra_params("medusa", cfg) == 64  # blocks only: the LM head is the target's
    assert extra_params("ngram", cfg) == 0


def test_request_timing_from_vllm_stats():
    from types import SimpleNamespace

    from vllm.v1.metrics.stats import RequestStateStats

    stats = RequestStateStats(num_generation_tokens=5, first_token_ts=10.0, last_token_ts=10.4)
    stats.first_token_latency = 0.25
    ttft, tpot = request_timing(SimpleNamespace(metrics=stats))
    assert ttft == 0.25 and tpot == pytest.approx(0.1)  # 4 tokens after the first in 0.4 s
    stats.num_generation_tokens = 1
    assert request_timing(SimpleNamespace(metrics=stats))[1] is None


def test_suffix_needs_arctic_inference(dirs, monkeypatch):
    import vllm_specstream.bench.bench as bench

    monkeypatch.setattr(bench, "has_suffix_decoding", lambda: False)
    with pytest.raises(ValueError, match="--methods suffix needs arctic-inference"):
        BenchConfig(checkpoint=str(dirs[0]), methods=("suffix",))


def test_groups_and_progress_steps(dirs):
    assert [list(g) for g in groups(5, 2)] == [[0, 1], [2, 3], [4]]
    cfg = BenchConfig(
        checkpoint=str(dirs[0]), num_prompts=5, batch_sizes=(1, 2), temperatures=(0.0,), repeats=2
    )
    assert steps_per_method(cfg) == 1 + (5 + 3) * 2


def _cell(t, b, rates, tokens, out, drafts=0.0, accepted=0.0, tpot=(0.05,)):
    return {
        "ttft_s": [0.2, 0.3, 0.4],
        "tpot_s": list(tpot),
        "temperature": t,
        "batch_size": b,
        "rates": rates,
        "tokens": tokens,
        "output_tokens": out,
        "drafts": drafts,
        "draft_tokens": 4 * drafts,
        "accepted": accepted,
    }


def test_summary_speedup_tokens_per_step_cr_ratio_lossless(dirs, tmp_path):
    cfg = BenchConfig(checkpoint=str(dirs[0]), methods=("plain", "specstream"))
    results = {
        "plain": {
            "cells": [_cell(0.0, 1, [10, 12, 11], [[1, 2]], 30), _cell(0.7, 1, [10], [[5]], 30)]
        },
        "specstream": {
            "cells": [
                _cell(0.0, 1, [20, 24, 22], [[1, 2]], 30, drafts=10, accepted=20, tpot=(0.02,)),
                _cell(0.7, 1, [15], [[6]], 30, drafts=10, accepted=5),
            ]
        },
    }
    rows = {(r["method"], r["temperature"]): r for r in summarize(results, cfg)}
    greedy = rows[("specstream", 0.0)]
    assert greedy["speedup"] == 2.0 and greedy["tokens_per_step"] == 3.0
    assert greedy["cr_ratio"] == 3.0  # 30 tokens in 10 forward passes
    assert greedy["drafted_per_token"] == round(40 / 30, 3)  # 4 drafts per drafting step
    assert greedy["lossless"] is True and greedy["extra_params"] == 32
    # Decoding alone: plain's 50 ms per token over 20 ms; the prefill share shows in TTFT.
    assert greedy["tpot_ms"] == 20.0 and greedy["decode_speedup"] == 2.5
    assert greedy["ttft_ms"] == 300.0
    assert rows[("specstream", 0.7)]["lossless"] is None  # sampled: checked by a test instead
    assert rows[("plain", 0.0)]["speedup"] == 1.0 and rows[("plain", 0.0)]["cr_ratio"] == 1.0
    results["specstream"]["cells"][0]["tokens"] = [[1, 3]]
    assert not [r for r in summarize(results, cfg) if r["temperature"] == 0][1]["lossless"]
    table = markdown_table(summarize(results, cfg))
    row = (
        "| specstream | 0 | 1 | 22.00 | 2.00x (plain) | 300.0 | 20.0 | 2.50x | 3.00 | 3.00 | **no** "
        "| 32 |"
    )
    assert row in table
    plot(summarize(results, cfg), tmp_path / "bench.png", "title")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_speedups_are_against_the_faster_plain_engine(dirs):
    # Plain decoding on every core beside the run's binding: each cell's speedup is against
    # the faster of the two; outputs are still compared with plain's.
    cfg = BenchConfig(checkpoint=str(dirs[0]), methods=("plain", "plain-all-cores", "specstream"))
    results = {
        "plain": {"cells": [_cell(0.0, 1, [10], [[1, 2]], 30), _cell(0.0, 4, [40], [[1]], 30)]},
        "plain-all-cores": {
            "cells": [_cell(0.0, 1, [16], [[1, 2]], 30), _cell(0.0, 4, [32], [[1]], 30)]
        },
        "specstream": {
            "cells": [
                _cell(0.0, 1, [24], [[1, 2]], 30, drafts=10, accepted=20),
                _cell(0.0, 4, [60], [[1]], 30, drafts=10, accepted=20),
            ]
        },
    }
    rows = {(r["method"], r["batch_size"]): r for r in summarize(results, cfg)}
    assert rows[("specstream", 1)]["speedup"] == 1.5
    assert rows[("specstream", 1)]["against"] == "plain-all-cores"
    assert (
        rows[("specstream", 4)]["speedup"] == 1.5 and rows[("specstream", 4)]["against"] == "plain"
    )
    assert rows[("plain", 1)]["speedup"] == 0.625 and rows[("specstream", 1)]["lossless"]
    assert "plain-all-cores" in cfg.methods
    nobind = BenchConfig(checkpoint=str(dirs[0]), omp_threads_bind="nobind")
    assert "plain-all-cores" not in nobind.methods  # the run's binding is every core already


def test_rounds_combine_per_round_speedups(dirs):
    cfg = BenchConfig(checkpoint=str(dirs[0]), methods=("plain", "specstream"), rounds=3)

    def round_rows(plain_rate, spec_rate, spec_tokens):
        results = {
            "plain": {"cells": [_cell(0.0, 1, [plain_rate], [[1, 2]], 30)]},
            "specstream": {
                "cells": [_cell(0.0, 1, [spec_rate], spec_tokens, 30, drafts=10, accepted=20)]
            },
        }
        return summarize(results, cfg)

    # The machine slows down between rounds: per-round ratios stay 2.0, 2.0, 1.5.
    rows = combine_rounds(
        [round_rows(10, 20, [[1, 2]]), round_rows(5, 10, [[1, 2]]), round_rows(8, 12, [[1, 2]])]
    )
    spec = rows[1]
    assert spec["method"] == "specstream" and spec["speedup"] == 2.0
    assert spec["speedup_per_round"] == [2.0, 2.0, 1.5] and spec["tok_s"] == 12.0
    assert spec["lossless"] is True and spec["tokens_per_step"] == 3.0
    rows = combine_rounds([round_rows(10, 20, [[1, 2]]), round_rows(10, 20, [[9]])])
    assert rows[1]["lossless"] is False  # one round differing from plain is enough
    with pytest.raises(ValueError, match="--rounds"):
        BenchConfig(checkpoint=str(dirs[0]), rounds=0)


def test_environment_knobs_reach_every_engine_and_the_report(dirs, monkeypatch):
    ckpt, _ = dirs
    monkeypatch.delenv(OMP_BIND, raising=False)
    default = BenchConfig(checkpoint=str(ckpt))
    assert OMP_BIND not in engine_env(default)
    assert env_setting(default) == f"{OMP_BIND}=auto"
    monkeypatch.setenv(OMP_BIND, "0")
    assert engine_env(default, "specstream")[OMP_BIND] == "0"
    assert env_setting(default) == f"{OMP_BIND}=0"  # the environment's knob is recorded
    nobind = BenchConfig(checkpoint=str(ckpt), omp_threads_bind="nobind")
    assert engine_env(nobind)[OMP_BIND] == "nobind"  # the flag wins over the environment
    assert env_setting(nobind) == f"{OMP_BIND}=nobind"


def _fields(method: str, cfg: BenchConfig) -> dict:
    return additional_config_for(method, cfg)["specstream"]


def test_trees_are_the_tree_methods_only(dirs):
    ckpt, _ = dirs
    cfg = BenchConfig(checkpoint=str(ckpt), tree_top_k="2,2,1,1", tree_nodes=6)
    assert additional_config_for("plain", cfg) is None
    assert "tree_top_k" not in _fields("specstream", cfg)
    assert "tree_top_k" not in _fields("specstream-fixed", cfg)
    assert _fields("specstream-tree", cfg)["tree_top_k"] == [2, 2, 1, 1]
    assert _fields("specstream-tree", BenchConfig(checkpoint=str(ckpt)))["tree_top_k"] == 2
    assert speculative_config_for("specstream-tree", cfg)["num_speculative_tokens"] == 6
    assert extra_params("specstream-tree", cfg) == 32
    # the fixed variant: the same trees, the adaptive policy off (a schedule of 6 drafts)
    fixed = speculative_config_for("specstream-tree-fixed", cfg)
    assert _fields("specstream-tree-fixed", cfg)["tree_top_k"] == [2, 2, 1, 1]
    assert fixed["num_speculative_tokens"] == 6
    assert fixed != speculative_config_for("specstream-tree", cfg)
    # the fixed variant never prunes (a checkpoint may carry a threshold); the pruned one and
    # the adaptive one (whose policy chooses per step) take the bench's threshold, else the
    # checkpoint's (the field left out)
    assert "tree_prune" not in _fields("specstream", cfg)
    assert _fields("specstream-tree-fixed", cfg)["tree_prune"] == "off"
    assert "tree_prune" not in _fields("specstream-tree-pruned", cfg)
    assert "tree_prune" not in _fields("specstream-tree", cfg)
    pruned = BenchConfig(checkpoint=str(ckpt), tree_prune="0.05")
    assert _fields("specstream-tree-pruned", pruned)["tree_prune"] == 0.05
    assert _fields("specstream-tree", pruned)["tree_prune"] == 0.05
    assert _fields("specstream-tree-fixed", pruned)["tree_prune"] == "off"
    assert speculative_config_for("specstream-tree-pruned", cfg) == fixed


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("tree_top_k", "two", None),
        ("tree_top_k", "2,0", "tree_top_k"),
        ("tree_prune", "1.5", "tree_prune"),
    ],
)
def test_bad_tree_flags_are_refused_before_any_engine_starts(dirs, flag, value, field):
    ckpt, _ = dirs
    with pytest.raises(ValueError, match="--tree-top-k, --tree-prune") as refused:
        BenchConfig(checkpoint=str(ckpt), methods=("specstream-tree",), **{flag: value})
    if field is not None:
        assert f"['{field}']" in str(refused.value)


def test_the_plugins_fields_reach_every_specstream_method(dirs):
    ckpt, _ = dirs
    cfg = BenchConfig(checkpoint=str(ckpt), specstream_fields={"placement": "window"})
    for method in ("specstream", "specstream-fixed", "specstream-tree-fixed"):
        assert _fields(method, cfg)["placement"] == "window", method
    assert additional_config_for("medusa", cfg) is None
    with pytest.raises(ValueError, match=r"\['placement'\]='middle'"):
        BenchConfig(checkpoint=str(ckpt), specstream_fields={"placement": "middle"})


def test_a_draft_vocabulary_is_not_counted_as_parameters(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {
            "specstream.stream_embeddings": torch.zeros(4, 8),
            "specstream.draft_vocab_mask": torch.ones(100),
        },
        str(ckpt / "specstream.safetensors"),
    )
    (ckpt / "config.json").write_text("{}")
    assert extra_params("specstream", BenchConfig(checkpoint=str(ckpt))) == 32


def test_compile_flag_runs_every_engine_compiled(dirs, monkeypatch):
    """``--compile`` turns off the eager mode of every engine and says so in the report."""
    import vllm_specstream.bench.bench as bench
    from vllm_specstream.cli import main

    ckpt, _ = dirs
    seen = []
    monkeypatch.setattr(bench, "run_bench", seen.append)
    for flags, mode in (([], "eager"), (["--compile"], "compiled")):
        assert main(["bench", str(ckpt), "--methods", "plain", *flags]) == 0
        cfg = seen.pop()
        assert bench.engine_mode(cfg) == mode
        kwargs = {"enforce_eager": True, **cfg.engine_options}  # run_cells' order
        assert kwargs["enforce_eager"] is (mode == "eager")


def test_suffix_drafts_are_specstream_suffix_only(dirs, monkeypatch):
    import vllm_specstream.bench.bench as bench

    ckpt, _ = dirs
    monkeypatch.setattr(bench, "has_suffix_decoding", lambda: True)
    cfg = BenchConfig(checkpoint=str(ckpt), methods=("specstream", "specstream-suffix"))
    # 'off', not left out: a checkpoint's suffix_drafts default must not turn them on either.
    for method in ("specstream", "specstream-fixed", "specstream-tree"):
        assert _fields(method, cfg)["suffix_drafts"] == "off", method
    assert _fields("specstream-suffix", cfg)["suffix_drafts"] == "on"
    score = BenchConfig(checkpoint=str(ckpt), methods=("specstream-suffix",), suffix_drafts="2")
    assert _fields("specstream-suffix", score)["suffix_drafts"] == "2"
    assert speculative_config_for("specstream-suffix", cfg) == speculative_config_for(
        "specstream", cfg
    )
    assert "specstream-suffix" in bench.FRESH_ENGINE_PER_CELL  # the global tree learns
    with pytest.raises(ValueError, match="--suffix-drafts"):
        BenchConfig(checkpoint=str(ckpt), methods=("specstream-suffix",), suffix_drafts="off")
    monkeypatch.setattr(bench, "has_suffix_decoding", lambda: False)
    with pytest.raises(ValueError, match="--methods specstream-suffix needs arctic-inference"):
        BenchConfig(checkpoint=str(ckpt), methods=("specstream-suffix",))


def test_an_interrupted_method_stops_its_whole_process_group():
    import subprocess
    import sys
    import time

    from vllm_specstream.bench.bench import stop_process_group

    # A child that starts a grandchild in its group (as vLLM starts its engine processes)
    # and ignores SIGTERM, as a busy engine may.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(g.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = int(proc.stdout.readline())
    start = time.monotonic()
    stop_process_group(proc, grace=0.5)
    proc.wait(timeout=5)

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped by init) is not
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the grandchild outlived its group"
    assert time.monotonic() - start < 5


def test_the_default_methods_are_the_same_from_python_and_the_command_line(dirs, monkeypatch):
    import vllm_specstream.bench.bench as bench
    from vllm_specstream.cli import main

    ckpt, medusa = dirs
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda cfg: ran.append(cfg) or {})
    for extra in ([], ["--medusa", str(medusa)]):
        main(["bench", str(ckpt), *extra])
        from_python = BenchConfig(checkpoint=str(ckpt), medusa=extra[-1] if extra else None)
        assert ran[-1].methods == from_python.methods
        assert {"plain", "plain-control", "ngram", "specstream"} <= set(from_python.methods)
        assert ("medusa" in from_python.methods) == bool(extra)
        assert "specstream-fixed" not in from_python.methods
