"""``benchmarks/table1.py``: which bench run and evaluations make a task's rows."""

import json
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def table1():
    yield load_benchmark("table1", register=True)
    sys.modules.pop("table1", None)


def _bench_row(method: str, batch_size: int = 1, speedup: float = 1.0) -> dict:
    return {
        "method": method,
        "temperature": 0,
        "batch_size": batch_size,
        "speedup": speedup,
        "decode_speedup": speedup,
        "cr_ratio": 2.0,
        "tokens_per_step": 2.5,
        "extra_params": 0,
        "lossless": True,
    }


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _eval(rouge1: float, chain: float) -> dict:
    return {"rouge1": rouge1, "rougeLsum": rouge1 - 5, "tokens_per_step": {"chain": chain}}


def test_evaluations_beside_the_bench_run_win_over_the_tasks(table1, tmp_path):
    task = table1.Task("e2e", "E2E", ("rouge1", "rougeLsum"), 3.72, (("avx2", "run/bench.json"),))
    rows = [_bench_row("plain"), _bench_row("specstream", speedup=1.6), _bench_row("ngram", 4)]
    _write(tmp_path / "e2e" / "run" / "bench.json", {"rows": rows})
    _write(tmp_path / "e2e" / "eval-specstream.json", _eval(80.0, 2.2))
    _write(tmp_path / "e2e" / "eval-ntp.json", _eval(79.0, 1.0))
    _write(tmp_path / "e2e" / "run" / "eval-specstream.json", _eval(83.4, 3.35))

    got = {r["method"]: r for r in table1.task_rows(task, tmp_path)}

    # batch-1 rows only, in the table's order, with the run's own evaluation as the metric
    assert list(got)[:2] == ["plain", "specstream"] and "ngram" not in got
    assert got["specstream"]["speedup"] == 1.6 and got["specstream"]["metric"] == "83.4 / 78.4"
    reference = got["specstream, reference decoder (chain / tree)"]
    assert reference["tokens_per_step"] == (3.35, None)
    # no baseline beside the run: the task's
    assert got["ntp LoRA baseline (same data, steps)"]["metric"] == "79.0 / 74.0"
    assert "| 3.35 / - |" in table1.markdown(list(got.values()))


def test_a_task_without_results_has_no_rows(table1, tmp_path):
    assert table1.task_rows(table1.TASKS[0], tmp_path) == []


def test_each_cpu_class_reads_its_own_run(table1, tmp_path):
    runs = (("avx2", "a/bench.json"), ("avx512_bf16", "b/bench.json"))
    task = table1.Task("sql", "SQL", ("exact_match",), 3.57, runs)
    _write(tmp_path / "sql" / "a" / "bench.json", {"rows": [_bench_row("specstream", speedup=0.9)]})
    _write(tmp_path / "sql" / "b" / "bench.json", {"rows": [_bench_row("specstream", speedup=1.2)]})

    def speedup(cpu_class):
        rows = table1.task_rows(task, tmp_path, cpu_class)
        return next(r["speedup"] for r in rows if r["method"] == "specstream")

    assert speedup("avx2") == 0.9 and speedup("avx512_bf16") == 1.2
    # a class without a run of its own has no rows (never another class's numbers)
    only_avx2 = table1.Task("sql", "SQL", ("exact_match",), 3.57, runs[:1])
    assert table1.task_rows(only_avx2, tmp_path, "avx512_bf16") == []


def test_the_adapters_evaluations_serve_every_class(table1, tmp_path):
    runs = (("avx2", "a/bench.json"), ("avx512_bf16", "b/bench.json"))
    task = table1.Task("e2e", "E2E", ("rouge1", "rougeLsum"), 3.72, runs, evals="a")
    for run in ("a", "b"):
        _write(tmp_path / "e2e" / run / "bench.json", {"rows": [_bench_row("specstream")]})
    _write(tmp_path / "e2e" / "a" / "eval-specstream.json", _eval(85.0, 3.29))
    _write(tmp_path / "e2e" / "eval-specstream.json", _eval(82.7, 2.23))  # an older adapter's

    rows = {r["method"]: r for r in table1.task_rows(task, tmp_path, "avx512_bf16")}
    assert rows["specstream"]["metric"] == "85.0 / 80.0"


def test_methods_come_in_the_tables_order_whatever_the_runs(table1, tmp_path):
    task = table1.Task("dialogsum", "DialogSum", ("rouge1",), 2.62, (("avx2", "r/bench.json"),))
    ran = ("specstream-tree", "suffix", "specstream-suffix", "plain", "specstream", "ngram")
    _write(tmp_path / "dialogsum" / "r" / "bench.json", {"rows": [_bench_row(m) for m in ran]})

    got = [r["method"] for r in table1.task_rows(task, tmp_path) if r["speedup"] is not None]

    assert got == ["plain", "ngram", "suffix", "specstream", "specstream-suffix", "specstream-tree"]


def test_a_second_run_adds_the_methods_the_first_lacks(table1, tmp_path):
    runs = (("avx512_bf16", "a/bench.json"), ("avx512_bf16", "b/bench.json"))
    task = table1.Task("sql", "SQL", ("exact_match",), 3.57, runs)
    first = [_bench_row("plain"), _bench_row("specstream", speedup=1.5)]
    second = [_bench_row("plain"), _bench_row("specstream", speedup=1.1)]
    second.append(_bench_row("specstream-suffix", speedup=1.9))
    _write(tmp_path / "sql" / "a" / "bench.json", {"rows": first})
    _write(tmp_path / "sql" / "b" / "bench.json", {"rows": second})

    rows = table1.task_rows(task, tmp_path, "avx512_bf16")
    got = {r["method"]: r["speedup"] for r in rows}

    assert got["specstream"] == 1.5 and got["specstream-suffix"] == 1.9
    # each row names the run whose plain engine its speedup is against
    lines = table1.markdown(rows).splitlines()
    assert next(line for line in lines if "| specstream |" in line).endswith("| a |")
    assert next(line for line in lines if "| specstream-suffix |" in line).endswith("| b |")
