"""The paper's Table 1 on the real tasks, from the committed results: one row per task and
method (speedup at batch 1, call reduction, task metric, extra parameters), beside the
paper's OPT-1.3b call reductions, as Markdown and a plot.

Reads, per task and CPU class, the ``bench.json`` of its ``specstream bench`` runs under
``benchmarks/results/<task>/<cpu-class>/`` (:attr:`Task.runs`: runs with the engine on both
cores and the methods beside specstream; AVX512-BF16: vLLM's compiled mode) and the ``eval-<model>.json`` files
of ``specstream eval`` on the same validation split, from the bench run's directory, else the
served adapter's (:attr:`Task.evals`), else the task's (``benchmarks/results/<task>/``):
``eval-specstream.json`` (tokens per step of the reference decoder and the task metric) and
``eval-ntp.json`` (the next-token LoRA baseline's metric). Missing files give missing rows.

    .venv/bin/python benchmarks/table1.py [--cpu-class avx2|avx512_bf16|amx]
        [--results benchmarks/results] [--out DIR]

The AVX2 table is ``table1.md`` / ``table1.png``; another class's has the class in its name
(``table1-avx512_bf16.md``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from vllm_specstream.bench.bench import METHODS as BENCH_METHODS

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Task:
    """One real task of Table 1."""

    name: str
    """Results directory under ``benchmarks/results`` and the ``--task`` of the CLI."""
    title: str
    metrics: tuple[str, ...]
    """Keys of the eval JSON, in the order shown."""
    paper_cr: float
    """The paper's call reduction for OPT-1.3b with tree drafts (its Table 1)."""
    runs: tuple[tuple[str, str], ...] = (("avx2", "bench.json"),)
    """``(CPU class, bench run)`` pairs: the runs of each class's table, relative to the task's
    results directory. A class with several runs takes each method's row from the first run
    that has it (every speedup is against the plain engine of its own run)."""
    evals: str = ""
    """Where the served adapter's evaluations are (relative to the task's directory; they hold
    on every CPU), read where its bench run has none beside it."""

    def bench(self, cpu_class: str) -> list[str]:
        return [run for c, run in self.runs if c == cpu_class]


#: The CPU classes with a table (the first: ``table1.md``).
CPU_CLASSES = ("avx2", "avx512_bf16", "amx")


def runs(*avx512_bf16: str) -> tuple[tuple[str, str], ...]:
    """Each class's runs of a task: AVX2's eager ``avx2/bench.json``; on AVX512-BF16 the
    compiled batch-1 runs ``avx512_bf16/<run>/bench.json`` (vLLM's default mode), the newest
    first: the run beside vLLM's ``eagle3`` gives the rows it has (plain, a second plain
    engine, EAGLE-3, specstream as served), earlier runs the other methods; on AMX the
    compiled run beside vLLM's ``eagle3``, ``amx/eagle3/bench.json``."""
    return (
        (("avx2", "avx2/bench.json"),)
        + tuple(("avx512_bf16", f"avx512_bf16/{run}/bench.json") for run in avx512_bf16)
        + (("amx", "amx/eagle3/bench.json"),)
    )


#: Where the committed adapters' evaluations are (development files; every class).
EVALS = "avx512_bf16"

TASKS = (
    Task(
        "sql",
        "SQL (Spider, unseen database)",
        ("exact_match",),
        3.57,
        runs("eagle3-b1", "compiled-b1-compiled-pass", "compiled-b1-compiled-pass-suffix"),
        EVALS,
    ),
    Task(
        "e2e",
        "E2E NLG (unseen MRs)",
        ("rouge1", "rougeLsum"),
        3.72,
        runs("eagle3-b1", "compiled-b1-compiled-pass"),
        EVALS,
    ),
    Task(
        "dialogsum",
        "DialogSum (unseen dialogues)",
        ("rouge1", "rougeLsum"),
        2.62,
        runs("eagle3-b1", "compiled-b1-compiled-pass", "compiled-b1-all"),
        EVALS,
    ),
)
#: Methods of ``specstream bench`` in the table, in the bench's order (``plain-control``: a
#: second plain engine, the run's noise floor); the fixed-schedule and pruned-tree variants are
#: ablations, left to their own runs' tables.
METHODS = tuple(
    m
    for m in BENCH_METHODS
    if m not in ("specstream-fixed", "specstream-tree-fixed", "specstream-tree-pruned")
)


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _metric(evaluation: dict | None, task: Task) -> str:
    if not evaluation:
        return "-"
    return " / ".join(f"{evaluation[m]:.1f}" for m in task.metrics if m in evaluation) or "-"


def _row(task: Task, method: str, metric: str = "-", **measured) -> dict:
    """One table row; the measurements a row lacks are None (shown as "-")."""
    keys = ("speedup", "decode_speedup", "cr_ratio", "tokens_per_step", "extra_params", "run")
    return {"task": task.title, "method": method, "metric": metric} | {
        key: measured.get(key) for key in keys
    }


def task_rows(task: Task, results: Path, cpu_class: str = CPU_CLASSES[0]) -> list[dict]:
    """The table's rows for ``task`` on ``cpu_class``: vLLM methods at batch 1, then the
    reference decoder."""
    runs = task.bench(cpu_class)
    if not runs:
        return []
    here = results / task.name
    by_method: dict[str, dict] = {}
    for run in runs:
        for row in (_read(here / run) or {}).get("rows", []):
            if row["temperature"] == 0 and row["batch_size"] == 1:
                by_method.setdefault(row["method"], row | {"run": Path(run).parent.name})
    # The evaluations of the adapter the bench ran: beside its (first) bench.json, else where
    # the served adapter's are, else the task's (each directory read once: they may coincide).
    dirs = tuple(dict.fromkeys((here / Path(runs[0]).parent, here / task.evals, here)))
    spec_eval = next(filter(None, (_read(d / "eval-specstream.json") for d in dirs)), None)
    ntp_eval = next(filter(None, (_read(d / "eval-ntp.json") for d in dirs)), None)
    rows = [
        # Every method is lossless against plain: same outputs, same metric (the bench checks).
        _row(
            task,
            method,
            _metric(spec_eval, task) if row["lossless"] else "differs",
            speedup=row["speedup"],
            decode_speedup=row.get("decode_speedup"),
            cr_ratio=row["cr_ratio"],
            tokens_per_step=row["tokens_per_step"],
            extra_params=row["extra_params"],
            run=row["run"],
        )
        for method in METHODS
        if (row := by_method.get(method)) is not None
    ]
    if spec_eval:
        tps = spec_eval["tokens_per_step"]
        rows.append(
            _row(
                task,
                "specstream, reference decoder (chain / tree)",
                _metric(spec_eval, task),
                tokens_per_step=(tps["chain"], tps.get("tree")),
                extra_params=spec_eval.get("extra_params"),
            )
        )
    if ntp_eval:
        rows.append(
            _row(
                task,
                "ntp LoRA baseline (same data, steps)",
                _metric(ntp_eval, task),
                extra_params=0,
            )
        )
    if rows:
        rows.append(_row(task, "paper, OPT-1.3b, trees", cr_ratio=task.paper_cr))
    return rows


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return " / ".join(_cell(v, fmt) for v in value)
    return format(value, fmt)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| task | method | speedup b1 | decoding-only speedup b1 | CR ratio | tokens per step | "
        "metric | extra params | run (speedups against its plain engine) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['method']} | {_cell(r['speedup'], '.2f')}"
            f"{'x' if r['speedup'] is not None else ''} | {_cell(r['decode_speedup'], '.2f')}"
            f"{'x' if r['decode_speedup'] is not None else ''} | {_cell(r['cr_ratio'], '.2f')} | "
            f"{_cell(r['tokens_per_step'], '.2f')} | {r['metric']} | "
            f"{_cell(r['extra_params'], ',')} | {r['run'] or '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, machine: str = "") -> None:
    """Batch-1 speedup per task and method (bars), call reduction written on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["speedup"] is not None and r["method"] != "plain"]
    tasks = list(dict.fromkeys(r["task"] for r in measured))
    methods = [m for m in METHODS if m != "plain" and any(r["method"] == m for r in measured)]
    if not measured:
        return
    fig, ax = plt.subplots(figsize=(2.4 + 2.2 * len(tasks), 3.6))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        labelled = False
        for i, task in enumerate(tasks):
            row = next((r for r in measured if r["task"] == task and r["method"] == method), None)
            if row is None:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            ax.bar(x, row["speedup"], width, color=f"C{j}", label=None if labelled else method)
            labelled = True
            ax.text(x, row["speedup"], f"{row['cr_ratio']:.2f}", ha="center", va="bottom", size=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), [t.split(" (")[0] for t in tasks])
    ax.set_ylabel("speedup over plain vLLM, batch 1")
    ax.set_title(f"Table 1 on real data{machine} (numbers: CR ratio)", size=10)
    ax.legend(fontsize=8, ncol=len(methods), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-class",
        choices=CPU_CLASSES,
        default=CPU_CLASSES[0],
        help="whose bench runs make the table (each task's run on a CPU of that class)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=RESULTS, help="table1[-CLASS].md and .png")
    args = parser.parse_args()
    rows = [row for task in TASKS for row in task_rows(task, args.results, args.cpu_class)]
    if not rows:
        raise SystemExit(f"{args.results}: no bench runs or eval-*.json files for {args.cpu_class}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "table1" if args.cpu_class == CPU_CLASSES[0] else f"table1-{args.cpu_class}"
    (args.out / f"{name}.md").write_text(markdown(rows))
    plot(rows, args.out / f"{name}.png", f", {args.cpu_class}")
    print(markdown(rows), end="")
    print(f"wrote {args.out / name}.md and {args.out / name}.png")


if __name__ == "__main__":
    main()
