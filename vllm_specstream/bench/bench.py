"""``specstream bench``: plain vLLM vs ngram, suffix, Medusa, EAGLE-3 and speculative streaming.

Every method serves the same checkpoint (Medusa adds its heads on top, EAGLE-3 its drafter)
with the same
prompts, engine settings, batch sizes and temperatures. Each method runs in its own child
process (a fresh engine, nothing shared), one after the other, so timings are comparable
within one run; speedups are ratios to plain decoding measured in that same run. A shared
machine drifts over minutes: ``rounds`` > 1 runs the methods again, in reverse order every
other round, and reports per cell the median over rounds of each round's speedup.

Reported per (method, temperature, batch size): output tokens/s (median over the batches
of all repeats), ``speedup`` vs plain, ``tokens_per_step`` (1 + accepted drafts per
drafting step, vLLM's counters), ``cr_ratio`` (output tokens per target forward pass of a
request; plain = 1.0), ``ttft_ms`` and ``tpot_ms`` (medians over requests of the time to the
first token and of the decoding time per further output token, from vLLM's per-request
timestamps) and ``decode_speedup`` (plain's ``tpot_ms`` over the method's: the speedup of
decoding alone, without the prefill that speculation cannot shorten), ``lossless`` (greedy
only: token-identical to plain at the same batch size), ``extra_params`` (parameters over
the served checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_specstream.logger import init_logger

# make suffix-decoding's build: put on the engines' PYTHONPATH when present (vLLM's own
# ``suffix`` method imports arctic-inference as installed).
from vllm_specstream.speculation.suffix_drafts import SUFFIX_DECODING_DIR
from vllm_specstream.training.tasks.holdout import DEFAULT_VAL_FRACTION

logger = init_logger(__name__)

#: ``specstream-fixed`` drafts ``num_speculative_tokens`` at every batch size (adaptive policy
#: off): the row that shows where speculation stops paying. ``specstream-tree`` drafts trees
#: (``tree_top_k`` candidates per stream, up to ``tree_nodes`` nodes) verified inside vLLM, where
#: the adaptive policy finds they pay (its width, and pruning where the checkpoint has an
#: early-exit adapter, chosen per step); ``specstream-tree-fixed`` drafts the whole tree at every
#: step, never pruned, and ``specstream-tree-pruned`` too, pruned by the checkpoint's early-exit
#: adapter (``tree_prune``). ``specstream-suffix`` is specstream with suffix-tree drafts beside
#: the streams (field ``suffix_drafts``, :mod:`vllm_specstream.speculation.suffix_drafts`).
#: ``plain-control`` is a second plain engine: its "speedup" is the run's noise floor
#: (engines differ by a few percent from one start to the next on small VMs).
#: ``plain-all-cores`` is plain decoding with its worker on every core (``nobind``) beside
#: ``plain`` on the run's binding (vLLM's ``auto`` leaves a 2-core machine's engine one
#: thread, while a speculating engine gets both): speedups are against the faster of the two
#: (:func:`plain_reference`), so that none owes to a thread count.
PLAIN_ALL_CORES = "plain-all-cores"
PLAIN_METHODS = ("plain", "plain-control", PLAIN_ALL_CORES)
METHODS = (
    "plain",
    "plain-control",
    PLAIN_ALL_CORES,
    "ngram",
    "suffix",
    "medusa",
    "eagle3",
    "specstream",
    "specstream-fixed",
    "specstream-suffix",
    "specstream-tree",
    "specstream-tree-fixed",
    "specstream-tree-pruned",
)
#: Methods that draft trees (field ``tree_top_k`` of their engine).
TREE_METHODS = ("specstream-tree", "specstream-tree-fixed", "specstream-tree-pruned")
#: Methods a bench runs only when named (``--methods``).
ON_REQUEST = ("specstream-fixed", "specstream-suffix", *TREE_METHODS)
#: Methods that import arctic-inference's suffix trees in the engine.
SUFFIX_METHODS = ("suffix", "specstream-suffix")


def default_methods(medusa: str | None, eagle3: str | None = None) -> tuple[str, ...]:
    """Every method but those run on request: ``medusa`` only with heads, ``eagle3`` only
    with a drafter, ``suffix`` only where arctic-inference is importable."""
    return tuple(
        m
        for m in METHODS
        if m not in ON_REQUEST
        and (medusa or m != "medusa")
        and (eagle3 or m != "eagle3")
        and (m != "suffix" or has_suffix_decoding())
    )


#: Methods that draft from earlier requests' outputs (suffix decoding's global tree): the
#: bench sends the same prompts in every cell and repeat, so each of those gets a fresh
#: engine; otherwise they would draft each answer from its own earlier copy.
FRESH_ENGINE_PER_CELL = SUFFIX_METHODS

#: Warm-up request of a fresh engine: none of the prompts, so that nothing is learnt from them.
WARM_UP_PROMPT = "Count from one to twenty."


#: vLLM's CPU worker thread binding (``auto``: all cores but one, kept for the front-end).
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass
class BenchConfig:
    """One benchmark run."""

    checkpoint: str
    """Merged specstream checkpoint (``specstream export``): the served model."""
    out_dir: str = "bench-results"
    """Where ``bench.json``, ``bench.md`` and ``bench.png`` are written."""
    methods: tuple[str, ...] | None = None
    """Subset of ``METHODS``; ``plain`` is always run (speedups are relative to it). None:
    :func:`default_methods`."""
    medusa: str | None = None
    """Medusa heads for the checkpoint (``specstream train --objective medusa --base CKPT``);
    required for the ``medusa`` method."""
    eagle3: str | None = None
    """EAGLE-3 drafter for the checkpoint (``specstream train --objective eagle3 --base
    CKPT``); required for the ``eagle3`` method."""
    task: str = "sql"
    """Task of the prompts: its synthetic test split, or the format of ``data``."""
    prompts: str | None = None
    """JSONL of prompts (``prompt``/``completion``, chat ``messages`` or sql records)."""
    data: str | None = None
    """A file in the public format of ``task`` (sql, e2e, dialogsum) whose ``split`` gives
    the prompts."""
    split: str = "all"
    """``all``, or the ``train``/``val`` side of the by-group split of ``data``."""
    val_fraction: float = DEFAULT_VAL_FRACTION
    """Held-out share of that split (the same as training's gives the same split)."""
    split_seed: int = 0
    """Seed of that split."""
    num_prompts: int = 16
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    num_speculative_tokens: int = 4
    """Draft length for every speculative method (Medusa: at most its number of heads)."""
    max_tokens: int = 128
    repeats: int = 2
    """Each (temperature, batch size) cell runs its prompts this many times."""
    rounds: int = 3
    """Times the whole method list runs (alternating order); speedups are the median of the
    per-round ratios (a shared machine's speed drifts over minutes)."""
    dtype: str = "float32"
    """fp32 is the fast dtype on CPUs without native bf16 matmuls (see README)."""
    ngram_lookup: tuple[int, int] = (2, 4)
    """``prompt_lookup_min``, ``prompt_lookup_max`` of vLLM's ngram method."""
    omp_threads_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` for every method's engine on CPU; None keeps the
    environment's (vLLM's default ``auto`` leaves one core to the front-end process,
    ``nobind`` lets the worker use every core)."""
    engine_options: dict = field(default_factory=dict)
    """Extra ``LLM(...)`` keyword arguments for every method."""
    specstream_options: dict = field(default_factory=dict)
    """Extra ``speculative_config`` fields for the specstream methods."""
    specstream_fields: dict = field(default_factory=dict)
    """Fields of ``additional_config["specstream"]`` (:mod:`vllm_specstream.speculation.settings`) for
    every specstream method."""
    tree_top_k: str = "2"
    """Field ``tree_top_k`` of the tree methods: one count, or one per stream (``2,2,1,1``)."""
    tree_nodes: int = 8
    """Draft tree nodes (its ``num_speculative_tokens``) of the tree methods."""
    tree_prune: str | None = None
    """Field ``tree_prune`` of ``specstream-tree-pruned`` and ``specstream-tree`` (a
    threshold or ``off``; None: the checkpoint's threshold)."""
    suffix_drafts: str = "on"
    """Field ``suffix_drafts`` of ``specstream-suffix`` (``on`` or a score threshold)."""

    def __post_init__(self) -> None:
        if self.methods is None:
            self.methods = default_methods(self.medusa, self.eagle3)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
        if "plain" not in self.methods:
            self.methods = ("plain", *self.methods)
        if self.omp_threads_bind == "nobind" and PLAIN_ALL_CORES in self.methods:
            self.methods = tuple(m for m in self.methods if m != PLAIN_ALL_CORES)  # = plain
        if "medusa" in self.methods and not self.medusa:
            raise ValueError(
                "--methods includes medusa but --medusa (the heads' directory) is not given"
            )
        if "eagle3" in self.methods and not self.eagle3:
            raise ValueError(
                "--methods includes eagle3 but --eagle3 (the drafter's directory) is not given"
            )
        for method in SUFFIX_METHODS:
            if method in self.methods:
                check_suffix_decoding(method)
        if "specstream-suffix" in self.methods:
            from vllm_specstream.checkpoint.config import suffix_min_score_from

            if suffix_min_score_from(self.suffix_drafts) is None:
                raise ValueError("--suffix-drafts: 'on' or a score threshold for specstream-suffix")
        from vllm_specstream.checkpoint.config import ConfigError
        from vllm_specstream.speculation.settings import check_environment, check_fields

        check_environment(os.environ)  # a retired variable: refused before any engine starts
        try:  # every method's fields, checked here rather than in each child process
            for method in self.methods:
                check_fields(additional_config_for(method, self))
        except (ConfigError, ValueError) as e:
            raise ValueError(f"--tree-top-k, --tree-prune or --suffix-drafts: {e}") from None
        if self.medusa and not (Path(self.medusa) / "config.json").is_file():
            raise ValueError(f"--medusa {self.medusa}: no config.json (a Medusa checkpoint?)")
        if self.eagle3 and not (Path(self.eagle3) / "config.json").is_file():
            raise ValueError(
                f"--eagle3 {self.eagle3}: no config.json (an EAGLE-3 drafter written by "
                "`specstream train --objective eagle3`?)"
            )
        if not (Path(self.checkpoint) / "config.json").is_file():
            raise ValueError(f"checkpoint {self.checkpoint}: no config.json")
        if min(self.batch_sizes) < 1 or min(self.num_prompts, self.repeats, self.rounds) < 1:
            raise ValueError("--batch-sizes, -n, --repeats and --rounds must be positive")
        if self.data and self.prompts:
            raise ValueError("give --data (a task file) or --prompts (JSONL), not both")
        if self.data:  # fail here, not in every method's child process
            from vllm_specstream.training.tasks import load_task_data, select_split

            select_split(
                load_task_data(self.task, self.data), self.split, self.val_fraction, self.split_seed
            )


def has_suffix_decoding() -> bool:
    """vLLM's ``suffix`` method imports arctic-inference's suffix tree in the engine."""
    import importlib.util

    if (SUFFIX_DECODING_DIR / "arctic_inference" / "suffix_decoding").is_dir():
        return True
    try:
        return importlib.util.find_spec("arctic_inference.suffix_decoding") is not None
    except ModuleNotFoundError:
        return False


def check_suffix_decoding(method: str = "suffix") -> None:
    if not has_suffix_decoding():
        raise ValueError(
            f"--methods {method} needs arctic-inference's suffix decoding, which is not "
            f"importable here nor in {SUFFIX_DECODING_DIR}; `make suffix-decoding` builds it "
            f"for this CPU, or drop {method} from --methods"
        )


def medusa_heads(medusa_dir: str) -> int:
    return int(json.loads((Path(medusa_dir) / "config.json").read_text())["num_heads"])


def speculative_config_for(method: str, cfg: BenchConfig) -> dict | None:
    """vLLM ``speculative_config`` of ``method`` (None for plain decoding)."""
    from vllm_specstream import speculative_config

    k = cfg.num_speculative_tokens
    if method in PLAIN_METHODS:
        return None
    if method == "ngram":
        lo, hi = cfg.ngram_lookup
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
        }
    if method == "suffix":
        # Suffix decoding (arctic-inference): a suffix tree over the prompt and past outputs.
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "medusa":
        return {
            "method": "medusa",
            "model": cfg.medusa,
            "num_speculative_tokens": min(k, medusa_heads(cfg.medusa)),
        }
    if method == "eagle3":
        # vLLM's EAGLE-3 proposer: the drafter's one layer run k times per step.
        return {"method": "eagle3", "model": cfg.eagle3, "num_speculative_tokens": k}
    if method in ("specstream", "specstream-suffix"):  # the latter: the same, with suffix drafts
        return speculative_config(k, **cfg.specstream_options)
    if method == "specstream-fixed":
        return speculative_config(k, **{**cfg.specstream_options, "adaptive": False})
    if method == "specstream-tree":
        return speculative_config(cfg.tree_nodes, **cfg.specstream_options)
    if method in ("specstream-tree-fixed", "specstream-tree-pruned"):
        return speculative_config(cfg.tree_nodes, **{**cfg.specstream_options, "adaptive": False})
    raise ValueError(method)


def additional_config_for(method: str, cfg: BenchConfig) -> dict | None:
    """vLLM ``additional_config`` of ``method``: the plugin's fields of a specstream method
    (trees for the tree methods only, suffix drafts for ``specstream-suffix`` only, whatever
    the checkpoint's default); None for the others."""
    from vllm_specstream.speculation.settings import KEY

    if not method.startswith("specstream"):
        return None
    fields = dict(cfg.specstream_fields)
    fields["suffix_drafts"] = cfg.suffix_drafts if method == "specstream-suffix" else "off"
    if method not in TREE_METHODS:
        fields.pop("tree_top_k", None)
        fields.pop("tree_prune", None)
    else:
        ks = [int(k) for k in str(cfg.tree_top_k).split(",")]
        fields["tree_top_k"] = ks[0] if len(ks) == 1 else ks
        prune = "off" if method == "specstream-tree-fixed" else cfg.tree_prune
        if prune is not None:
            fields["tree_prune"] = prune if prune == "off" else float(prune)
    return {KEY: fields}


def extra_params(method: str, cfg: BenchConfig) -> int:
    """Parameters a method adds over the served checkpoint's main model."""
    from safetensors import safe_open

    def count(path: Path, keep=lambda name: True) -> int:
        with safe_open(str(path), "pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if keep(k))  # noqa: SIM118

    if method.startswith("specstream"):
        from vllm_specstream.checkpoint.config import STREAM_PREFIX, counts_as_parameters
        from vllm_specstream.training.checkpoint import STREAM_FILE

        return count(
            Path(cfg.checkpoint) / STREAM_FILE,
            lambda k: counts_as_parameters(k.removeprefix(STREAM_PREFIX)),
        )
    if method == "medusa":
        # The heads share the target's LM head (``original_lm_head``): only blocks are new.
        return count(Path(cfg.medusa) / "model.safetensors", lambda k: k.startswith("blocks."))
    if method == "eagle3":
        # Everything the drafter stores (its own LM head over the draft vocabulary included;
        # the token embedding is the target's); ``d2t``/``t2d`` are index maps.
        return count(Path(cfg.eagle3) / "model.safetensors", lambda k: k not in ("d2t", "t2d"))
    return 0


def groups(n: int, batch_size: int) -> list[range]:
    """Consecutive prompt index ranges of ``batch_size`` (the last may be shorter)."""
    return [range(i, min(n, i + batch_size)) for i in range(0, n, batch_size)]


def steps_per_method(cfg: BenchConfig) -> int:
    """Generate calls one method makes (for the progress bar), the warm-up included."""
    calls = sum(len(groups(cfg.num_prompts, b)) for b in cfg.batch_sizes)
    return 1 + calls * cfg.repeats * len(cfg.temperatures)


def load_prompts(cfg: BenchConfig, tokenizer) -> list[str]:
    """Chat-templated prompts: the split of the task file, the JSONL file (both repeated
    up to ``num_prompts`` if shorter), or the task's synthetic test split."""
    from vllm_specstream.training.data import load_jsonl, prompt_text
    from vllm_specstream.training.tasks import build_task, load_task_data, select_split, to_example

    if cfg.data:
        records = load_task_data(cfg.task, cfg.data)
        messages = [
            r.messages for r in select_split(records, cfg.split, cfg.val_fraction, cfg.split_seed)
        ]
    elif cfg.prompts:
        messages = [e.messages for e in load_jsonl(cfg.prompts)]
        if not messages:
            raise ValueError(f"--prompts {cfg.prompts}: no records")
    else:
        records = build_task(cfg.task, "test", n=cfg.num_prompts)
        messages = [to_example(cfg.task, r).messages for r in records]
    messages = (messages * math.ceil(cfg.num_prompts / len(messages)))[: cfg.num_prompts]
    return [prompt_text(tokenizer, m) for m in messages]


def prompt_source(cfg: BenchConfig) -> str:
    """Where the prompts come from, for the report."""
    if cfg.data:
        split = f"{cfg.split} split (val_fraction {cfg.val_fraction}, seed {cfg.split_seed})"
        return f"{cfg.task} {cfg.data}, " + (split if cfg.split != "all" else "all records")
    return cfg.prompts or f"{cfg.task} test split"


# -- child process: one engine, every cell -------------------------------------------------


def _counters(llm) -> dict[str, float]:
    return {
        m.name: float(getattr(m, "value", 0) or 0)
        for m in llm.get_metrics()
        if "spec_decode" in m.name
    }


def request_timing(output) -> tuple[float, float | None]:
    """``(time to first token, decoding seconds per further output token or None)`` of one
    finished request, from vLLM's per-request stats (``RequestOutput.metrics``)."""
    stats = output.metrics
    n = stats.num_generation_tokens
    per_token = (stats.last_token_ts - stats.first_token_ts) / (n - 1) if n > 1 else None
    return stats.first_token_latency, per_token


def engine_mode(cfg: BenchConfig) -> str:
    """``eager``, or ``compiled`` where the engines run vLLM's torch.compile of the decoder."""
    return "eager" if cfg.engine_options.get("enforce_eager", True) else "compiled"


def run_cells(method: str, cfg: BenchConfig, emit=print) -> dict:
    """Run every (temperature, batch size) cell of ``method`` on one engine (a fresh one per
    cell and repeat for :data:`FRESH_ENGINE_PER_CELL`)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    prompts = load_prompts(cfg, AutoTokenizer.from_pretrained(cfg.checkpoint))
    kw = cpu_engine_kwargs(dtype=cfg.dtype, max_num_seqs=max(cfg.batch_sizes), seed=0)
    kw.update(cfg.engine_options)
    spec = speculative_config_for(method, cfg)
    if spec is not None:
        kw["speculative_config"] = spec
    additional = additional_config_for(method, cfg)
    if additional is not None:
        kw["additional_config"] = additional

    def start_engine():
        engine = LLM(model=cfg.checkpoint, disable_log_stats=False, **kw)
        warm_up = SamplingParams(temperature=0.0, max_tokens=16)
        engine.generate([WARM_UP_PROMPT], warm_up, use_tqdm=False)
        return engine

    fresh = method in FRESH_ENGINE_PER_CELL
    llm = None if fresh else start_engine()
    emit("PROGRESS")
    cells = []
    for temperature in cfg.temperatures:
        params = SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens)
        for batch_size in cfg.batch_sizes:
            rates, tokens, out_tokens, ttft, tpot = [], None, 0, [], []
            drafts = draft_tokens = accepted = 0.0
            for repeat in range(cfg.repeats):
                if fresh:
                    if llm is not None:
                        llm.llm_engine.engine_core.shutdown()
                    llm = start_engine()
                # Each cell and repeat starts with no cached prefixes: an engine kept for
                # the next cell would otherwise find its prompts cached from the last one,
                # while a fresh engine's are not.
                llm.reset_prefix_cache()
                before = _counters(llm)
                run_tokens = []
                for g in groups(len(prompts), batch_size):
                    start = time.perf_counter()
                    outs = llm.generate([prompts[i] for i in g], params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    rates.append(n / elapsed)
                    out_tokens += n
                    run_tokens += [list(o.outputs[0].token_ids) for o in outs]
                    for o in outs:
                        first, per_token = request_timing(o)
                        ttft.append(first)
                        if per_token is not None:
                            tpot.append(per_token)
                    emit("PROGRESS")
                if repeat == 0:
                    tokens = run_tokens
                after = _counters(llm)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                drafts += delta.get("vllm:spec_decode_num_drafts", 0.0)
                accepted += delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
                draft_tokens += delta.get("vllm:spec_decode_num_draft_tokens", 0.0)
            cells.append(
                {
                    "temperature": temperature,
                    "batch_size": batch_size,
                    "rates": rates,
                    "tokens": tokens,
                    "output_tokens": out_tokens,
                    "drafts": drafts,
                    "draft_tokens": draft_tokens,
                    "accepted": accepted,
                    "ttft_s": ttft,
                    "tpot_s": tpot,
                }
            )
    llm.llm_engine.engine_core.shutdown()
    return {
        "method": method,
        "spec_config": spec,
        "additional_config": additional,
        # The worker's binding as the engine started it (the plugin gives a speculating
        # engine every core where vLLM's would leave it one thread: cpu_env).
        "omp_threads_bind": os.environ.get(OMP_BIND, "auto"),
        "cells": cells,
    }


def _child_main(payload: str) -> None:
    data = json.loads(payload)
    method = data.pop("_method")
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    result = run_cells(method, cfg, emit=_emit)
    _emit("RESULT " + json.dumps(result))


def _emit(line: str) -> None:
    # One write per line: vLLM's threads log to the same stdout while this one reports.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def engine_env(cfg: BenchConfig, method: str | None = None) -> dict[str, str]:
    """The environment of ``method``'s child process (None: what every method shares)."""
    env = dict(os.environ)
    if any(m in cfg.methods for m in SUFFIX_METHODS) and SUFFIX_DECODING_DIR.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SUFFIX_DECODING_DIR), env.get("PYTHONPATH")) if p
        )
    if cfg.omp_threads_bind:
        env[OMP_BIND] = cfg.omp_threads_bind
    if method == PLAIN_ALL_CORES:
        env[OMP_BIND] = "nobind"
    return env


def env_setting(cfg: BenchConfig, results: dict | None = None) -> str:
    """The engines' CPU worker thread binding, for the report, and the methods whose engine
    ran another (``results``: each method's :func:`run_cells`)."""
    binding = engine_env(cfg).get(OMP_BIND, "auto")
    other: dict[str, list[str]] = {}
    for method, result in (results or {}).items():
        ran = result.get("omp_threads_bind", binding)
        if ran != binding:
            other.setdefault(ran, []).append(method)
    return f"{OMP_BIND}={binding}" + "".join(
        f" ({', '.join(methods)}: {ran})" for ran, methods in other.items()
    )


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ``proc`` and every process of its group: SIGTERM, ``grace`` seconds for the child
    to exit, then SIGKILL for whatever is left (engine processes may outlive the child)."""
    import contextlib
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_method(method: str, cfg: BenchConfig, on_progress=lambda: None) -> dict:
    """Run ``method`` in a child process; ``on_progress`` is called after each generate."""
    payload = json.dumps({**asdict(cfg), "_method": method})
    log_path = Path(cfg.out_dir) / f"{method}.log"
    with open(log_path, "w") as log:
        # Its own process group: vLLM's engine-core and worker processes are the child's,
        # and an interrupted bench stops them all (else they stay, holding GiBs).
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_specstream.bench.bench", "--child", payload],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=engine_env(cfg, method),
            start_new_session=True,
        )
        result = None
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith("PROGRESS"):
                    on_progress()
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
                else:  # vLLM's own log lines (its logger writes to stdout): kept
                    log.write(line)
                    log.flush()
            code = proc.wait()
        except BaseException:
            stop_process_group(proc)
            raise
    if code != 0 or result is None:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"bench: method {method!r} failed (exit {code}); {log_path}:\n{tail}")
    return result


# -- summary ------------------------------------------------------------------------------


def plain_reference(results: dict[str, dict]) -> dict[tuple, dict]:
    """Per (temperature, batch size), the faster plain engine's cell of this run: ``plain``
    or ``plain-all-cores`` where it ran (its ``method`` says which)."""
    best: dict[tuple, dict] = {}
    for method in ("plain", PLAIN_ALL_CORES):
        for c in results.get(method, {}).get("cells", []):
            key = (c["temperature"], c["batch_size"])
            rate = statistics.median(c["rates"])
            if key not in best or rate > statistics.median(best[key]["rates"]):
                best[key] = {**c, "method": method}
    return best


def summarize(results: dict[str, dict], cfg: BenchConfig) -> list[dict]:
    """One row per (method, temperature, batch size), speedups against the faster plain
    engine in this run (:func:`plain_reference`), outputs against ``plain``'s."""
    plain = {(c["temperature"], c["batch_size"]): c for c in results["plain"]["cells"]}
    reference = plain_reference(results)
    rows = []
    for method, result in results.items():
        extra = extra_params(method, cfg)
        for c in result["cells"]:
            key = (c["temperature"], c["batch_size"])
            ref = reference[key]
            tok_s = statistics.median(c["rates"])
            passes = c["output_tokens"] - c["accepted"]
            tpot = _median_ms(c.get("tpot_s"))
            ref_tpot = _median_ms(ref.get("tpot_s"))
            rows.append(
                {
                    "method": method,
                    "temperature": c["temperature"],
                    "batch_size": c["batch_size"],
                    "tok_s": round(tok_s, 2),
                    "speedup": round(tok_s / statistics.median(ref["rates"]), 3),
                    "tokens_per_step": round(1 + c["accepted"] / c["drafts"], 3)
                    if c["drafts"]
                    else 1.0,
                    "cr_ratio": round(c["output_tokens"] / passes, 3) if passes else 1.0,
                    # Drafted tokens (verified rows beyond the first) per output token.
                    "drafted_per_token": round(c.get("draft_tokens", 0.0) / c["output_tokens"], 3)
                    if c["output_tokens"]
                    else 0.0,
                    "ttft_ms": _median_ms(c.get("ttft_s")),
                    "tpot_ms": tpot,
                    "decode_speedup": round(ref_tpot / tpot, 3) if tpot and ref_tpot else None,
                    "lossless": (c["tokens"] == plain[key]["tokens"])
                    if c["temperature"] == 0
                    else None,
                    "against": ref["method"],
                    "extra_params": extra,
                }
            )
    return rows


def _median_ms(seconds: list[float] | None) -> float | None:
    return round(1e3 * statistics.median(seconds), 2) if seconds else None


def combine_rounds(per_round: list[list[dict]]) -> list[dict]:
    """Rows of several rounds (same methods and cells) as one: median tok/s and speedup over
    rounds, mean tokens_per_step and cr_ratio, lossless only if lossless in every round."""
    if len(per_round) == 1:
        return per_round[0]
    rows = []
    for cells in zip(*per_round):
        first = dict(cells[0])
        for key in ("tok_s", "speedup", "ttft_ms", "tpot_ms", "decode_speedup"):
            values = [c[key] for c in cells if c.get(key) is not None]
            first[key] = round(statistics.median(values), 3) if values else None
        for key in ("tokens_per_step", "cr_ratio", "drafted_per_token"):
            first[key] = round(statistics.fmean(c[key] for c in cells), 3)
        if first["lossless"] is not None:
            first["lossless"] = all(c["lossless"] for c in cells)
        first["speedup_per_round"] = [c["speedup"] for c in cells]
        first["against"] = "/".join(sorted({c.get("against", "plain") for c in cells}))
        rows.append(first)
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| method | T | batch | tok/s | speedup (against) | TTFT ms | TPOT ms | decode speedup | "
        "tokens_per_step | cr_ratio | lossless | extra_params |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lossless = {True: "yes", False: "**no**", None: "n/a"}[r["lossless"]]
        ms = [_fmt(r.get(key), "{:.1f}") for key in ("ttft_ms", "tpot_ms")]
        decode = _fmt(r.get("decode_speedup"), "{:.2f}x")
        lines.append(
            f"| {r['method']} | {r['temperature']:g} | {r['batch_size']} | {r['tok_s']:.2f} | "
            f"{r['speedup']:.2f}x ({r.get('against', 'plain')}) | {ms[0]} | {ms[1]} | {decode} | "
            f"{r['tokens_per_step']:.2f} | {r['cr_ratio']:.2f} | "
            f"{lossless} | {r['extra_params']:,} |"
        )
    return head + "\n".join(lines) + "\n"


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Speedup vs batch size, one line per method, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted(
                (r["batch_size"], r["speedup"])
                for r in rows
                if r["method"] == method and r["temperature"] == t
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["batch_size"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup vs plain (output tok/s)")
        ax.set_title(f"temperature {t:g}")
        ax.legend()
    # wrapped to the figure's width: a one-panel figure cut a machine's long name off
    fig.suptitle(textwrap.fill(title, width=85 * len(temps)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Run every method, write ``bench.json``, ``bench.md``, ``bench.png``; return the report."""
    from tqdm.auto import tqdm

    from vllm_specstream.machine import describe_machine

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_method = steps_per_method(cfg)
    per_round = []
    total = per_method * len(cfg.methods) * cfg.rounds
    with tqdm(total=total, desc="bench", disable=not progress) as bar:
        for r in range(cfg.rounds):
            results = {}
            order = cfg.methods if r % 2 == 0 else tuple(reversed(cfg.methods))
            for method in order:
                bar.set_postfix_str(f"{method}, round {r + 1}/{cfg.rounds}")
                results[method] = run_method(method, cfg, on_progress=bar.update)
                # Raw per-batch numbers, kept even if a later method fails.
                suffix = f".round{r + 1}" if cfg.rounds > 1 else ""
                (out / f"{method}{suffix}.json").write_text(json.dumps(results[method]) + "\n")
            per_round.append(summarize({m: results[m] for m in cfg.methods}, cfg))
    rows = combine_rounds(per_round)
    machine = describe_machine()
    setting = (
        f"{cfg.num_prompts} prompts ({prompt_source(cfg)}), max_tokens "
        f"{cfg.max_tokens}, {cfg.dtype}, {engine_mode(cfg)}, k={cfg.num_speculative_tokens}, "
        f"{env_setting(cfg, results)}, {cfg.repeats} repeats, median tok/s over batches"
        + (f", {cfg.rounds} rounds (median of per-round speedups)" if cfg.rounds > 1 else "")
    )
    report = {
        "machine": machine,
        "checkpoint": cfg.checkpoint,
        "setting": setting,
        "config": asdict(cfg),
        "spec_configs": {m: r["spec_config"] for m, r in results.items()},
        "additional_configs": {m: r.get("additional_config") for m, r in results.items()},
        "rows": rows,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown_table(rows)
    (out / "bench.md").write_text(f"Machine: {machine}\n\nSetting: {setting}\n\n{table}")
    plot(rows, out / "bench.png", f"{Path(cfg.checkpoint).name} on {machine}")
    print(f"\nMachine: {machine}\nSetting: {setting}\n\n{table}")
    print(f"Wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        sys.exit("use `specstream bench --help`")
