"""Programs the engine tests run in a child process (one vLLM engine each, a fresh process so
that vLLM's global state and the plugin's registration are those of a user's process).

    python tests/vllm/engine_child.py NAME 'JSON-ARGS'

runs ``NAME(**args)``; a function's result is printed on one line as ``RESULT <json>`` (one
write: vLLM's threads log to the same stdout). :func:`run_child` is the tests' side.

Runs with the engine in one process start from a fork of a process that has imported vLLM
and PyTorch but started nothing (:class:`ForkServer`): the same fresh state as a new
process, without importing vLLM again for each engine (``test_tree_verification.py``, five
engines, run alone on 2 idle cores: 133 s with a fresh process per engine, 96 s forked).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

#: This file, to run as a program.
CHILD = __file__

#: The engine core and its worker in the child's own process (vLLM's in-process client and
#: single-process executor): an engine start then imports vLLM once, not three times (on a
#: 2-core AVX2-only CPU 24 s instead of 61 s for a one-request run). What the tests compare
#: runs the same either way; the user's process layout (front-end, engine core, worker) is
#: kept by runs that ask for it (``processes=True``) and by tensor-parallel ones.
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _llm(
    ckpt: str,
    k: int = 0,
    placement=None,
    adaptive: bool = False,
    spec_options=None,
    fields: dict | None = None,
    **engine,
):
    """``LLM(...)`` of ``ckpt`` drafting ``k`` (0: plain), configured as users configure it:
    vLLM's ``speculative_config`` and the plugin's ``fields`` (with ``placement``) in
    ``additional_config["specstream"]``."""
    from vllm import LLM

    from vllm_specstream import speculative_config
    from vllm_specstream.patches.cpu_env import cpu_engine_kwargs

    # A fixed KV cache (512 MiB: 11k tokens of the embedded model) instead of a share of
    # RAM: quicker to allocate, and engines start whatever else holds memory.
    if "gpu_memory_utilization" not in engine:
        engine.setdefault("kv_cache_memory_bytes", 512 << 20)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        engine.setdefault("distributed_executor_backend", "uni")
    kw = cpu_engine_kwargs(**{"dtype": "float32", "max_model_len": 1024, **engine})
    if k:
        kw["speculative_config"] = speculative_config(k, adaptive=adaptive, **(spec_options or {}))
    fields = {**(fields or {}), **({"placement": placement} if placement else {})}
    if fields:
        kw["additional_config"] = {"specstream": fields}
    return LLM(model=ckpt, **kw)


def _metrics(llm, *words: str) -> dict:
    return {
        m.name: getattr(m, "value", getattr(m, "values", None))
        for m in llm.get_metrics()
        if any(w in m.name for w in words)
    }


def _lora_requests(requests: list[dict]) -> dict:
    """``lora_request=`` for ``LLM.generate``: a request's ``"lora"`` is an adapter directory
    (one LoRA id per directory), None or absent for the served model alone."""
    from vllm.lora.request import LoRARequest

    paths = list(dict.fromkeys(r["lora"] for r in requests if r.get("lora")))
    if not paths:
        return {}
    ids = {path: i + 1 for i, path in enumerate(paths)}
    return {
        "lora_request": [
            LoRARequest(f"adapter{ids[r['lora']]}", ids[r["lora"]], r["lora"])
            if r.get("lora")
            else None
            for r in requests
        ]
    }


def generate(
    ckpt: str,
    k: int,
    engine: dict,
    requests: list[dict],
    placement=None,
    trees: bool = False,
    follow_up: int = 0,
    spec_options: dict | None = None,
    adaptive: bool = False,
    fields: dict | None = None,
    compare_layers: bool = False,
) -> dict:
    """Greedy outputs of ``requests`` (``"lora"``: an adapter directory, with
    ``enable_lora`` in ``engine``); with ``k``, drafting at every batch size (these runs
    check losslessness, not the policy) or, with ``adaptive``, as the policy chooses
    (``spec_options``: further ``speculative_config`` fields, e.g. a schedule; ``fields``:
    the plugin's), and per-request speculation metrics. ``compare_layers``: also
    :func:`_compare_stream_layers` (``"layers"``)."""
    from vllm import SamplingParams

    extra = {"per_request_spec_decode_metrics": "summary"} if k else {}
    llm = _llm(
        ckpt,
        k,
        placement,
        adaptive=adaptive,
        spec_options=spec_options,
        fields=fields,
        disable_log_stats=False,
        **engine,
        **extra,
    )
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=r["max_tokens"],
            stop=r.get("stop"),
            logprobs=r.get("logprobs"),
        )
        for r in requests
    ]
    loras = _lora_requests(requests)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False, **loras)
    # Graphs torch.compile made while serving (engine in this process: IN_PROCESS_ENV).
    inspected = {"graphs_compiled_serving": counters["stats"]["unique_graphs"] - graphs}
    per_request = [o.outputs[0].spec_decode_metrics for o in outs]
    if follow_up:
        # Each prompt and its output again, continued by ``follow_up`` tokens with their
        # logprobs: with prefix caching, the full blocks come from the cache the first run
        # wrote, so wrong keys/values there change these logprobs.
        from vllm.inputs import TokensPrompt

        again = [
            TokensPrompt(prompt_token_ids=list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
            for o in outs
        ]
        more = llm.generate(
            again, SamplingParams(temperature=0.0, max_tokens=follow_up, logprobs=0), use_tqdm=False
        )
        inspected["follow_up"] = [
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in more
        ]
        inspected["cached_tokens"] = sum(o.num_cached_tokens or 0 for o in more)
    if trees:  # needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
        from vllm_specstream.model_executor.trees.step import tree_stats

        inspected["trees"] = llm.apply_model(tree_stats)[0]
    if compare_layers:
        inspected["layers"] = llm.apply_model(_compare_stream_layers)[0]
    return {
        **inspected,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "text": [o.outputs[0].text for o in outs],
        "metrics": _metrics(llm, "spec_decode", "preemptions"),
        "per_request": [m.to_dict() if m else None for m in per_request],
    }


def features(ckpt: str, k: int, engine: dict, requests: list[dict]) -> dict:
    """``requests`` with vLLM's request features: each ``{"prompt", "params"}``, ``params``
    being ``SamplingParams`` fields (``structured_outputs``: ``StructuredOutputsParams``
    fields). Per request, each of its ``n`` outputs' tokens, text and chosen-token logprobs,
    its prompt logprobs, and its speculation metrics."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra = {"per_request_spec_decode_metrics": "summary"} if k else {}
    llm = _llm(ckpt, k, None, disable_log_stats=False, **engine, **extra)
    params = []
    for r in requests:
        fields = dict(r["params"])
        if "structured_outputs" in fields:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        params.append(SamplingParams(**fields))
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)

    def chosen(output) -> list[float] | None:
        if output.logprobs is None:
            return None
        return [lp[t].logprob for t, lp in zip(output.token_ids, output.logprobs)]

    return {
        "requests": [
            {
                "outputs": [
                    {"tokens": list(c.token_ids), "text": c.text, "logprobs": chosen(c)}
                    for c in o.outputs
                ],
                "prompt_logprobs": None
                if o.prompt_logprobs is None
                else [
                    None if lp is None else lp[t].logprob
                    for t, lp in zip(o.prompt_token_ids, o.prompt_logprobs)
                ],
                "spec": o.outputs[0].spec_decode_metrics
                and o.outputs[0].spec_decode_metrics.to_dict(),
            }
            for o in outs
        ],
        "metrics": _metrics(llm, "spec_decode"),
    }


def _compare_stream_layers(model) -> dict:
    """The stream pass's layer function (compiled in a compiled engine) against the eager
    one, per MSA layer, on the same random stand-in rows, main keys/values and cache: the
    largest difference over the eager output's largest value, and the same against the next
    layer's eager output (what a graph on another layer's weights would give)."""
    import torch

    from vllm_specstream.model_executor.stream_forward import StreamStart, msa_layer
    from vllm_specstream.streams.stream_math import joint_attention_mask

    runner = model.streams.runner()
    torch.manual_seed(0)
    attn = runner.layers[0].self_attn
    r, g, p, heads, d = 2, 3, 9, attn.num_kv_heads, attn.head_dim
    dtype = runner.layers[0].input_layernorm.weight.dtype
    cache = torch.randn(4, heads, 16, 2 * d, dtype=dtype)  # as vLLM's: outside inference mode
    pairs = list(zip(runner.layers, runner.weights.layers, strict=True))
    same, other = [], []
    with torch.inference_mode():
        index = torch.randint(0, cache.numel(), (r, p, heads, d))
        s = torch.randn(r * g, model.config.hidden_size, dtype=dtype)
        start = StreamStart(
            s=s,
            shape=torch.Size((r, 1, g, s.shape[1])),
            flat_pos=torch.randint(0, 64, (r * g,)),
            mask=joint_attention_mask(torch.ones(r, 1, p, dtype=torch.bool), g),
            kv_index=(index, torch.randint(0, cache.numel(), index.shape), heads),
        )
        for i, (layer, mm) in enumerate(pairs):
            out = runner._msa_layer(runner, layer, mm, s, start, cache)
            eager = msa_layer(runner, layer, mm, s, start, cache)
            nxt = msa_layer(runner, *pairs[(i + 1) % len(pairs)], s, start, cache)
            scale = float(eager.abs().max())
            same.append(float((out - eager).abs().max()) / scale)
            other.append(float((out - nxt).abs().max()) / scale)
    return {"compiled": runner._msa_layer is not msa_layer, "same": same, "other": other}


def probe(
    ckpt: str,
    max_tokens: list[int],
    prompts: list[str],
    placement: str,
    fields: dict | None = None,
) -> dict:
    """The model's last stash after each prompt decoded alone (``k = 3``); then, under a
    user's schedule (3 drafts alone, 2 for two requests, none from three), one prompt twice
    together (its stash: two requests with 2 streams run) and the drafts counted at batch
    32 and 1."""
    from vllm import SamplingParams

    from vllm_specstream.model_executor.specstream import stash_snapshot

    schedule = [(1, 1, 3), (2, 2, 2), (3, 1 << 16, 0)]
    llm = _llm(
        ckpt,
        3,
        placement,
        spec_options={"num_speculative_tokens_per_batch_size": schedule},
        fields=fields,
        disable_log_stats=False,
    )

    def drafts() -> float:
        return _metrics(llm, "spec_decode_num_drafts").get("vllm:spec_decode_num_drafts", 0)

    def snapshot(batch: list[str], n: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        outs = llm.generate(batch, params, use_tqdm=False)
        return {
            "max_tokens": n,
            "prompt_ids": [list(o.prompt_token_ids) for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "stash": llm.apply_model(stash_snapshot)[0],
        }

    # One request at a time: the last forward is that request's.
    results = [snapshot([p], n) for n in max_tokens for p in prompts]
    for _ in range(8):
        # The engine may start one request a step before the other; then the last forward
        # holds one request, which drafted 2 (window: decided at the step before) or 3.
        pair = snapshot([prompts[0]] * 2, 9)
        if any(row[0] >= 0 and row[2] < 0 for row in pair["stash"]["table"]):
            break
    counted = []
    for batch in (32, 1):
        before = drafts()
        params = SamplingParams(max_tokens=30, ignore_eos=True)
        llm.generate(prompts[:1] * batch, params, use_tqdm=False)
        counted.append(drafts() - before)
    return {"probes": results, "pair": pair, "schedule_drafts": counted}


def fail_to_start(ckpt: str, k: int, fields: dict | None = None) -> None:
    """Start ``ckpt`` with ``k`` drafts as a user would; the tests expect it to fail."""
    _llm(ckpt, k, adaptive=True, fields=fields, max_model_len=512)


def sample(ckpt: str, k: int, n: int, trees: bool = False, fields: dict | None = None) -> dict:
    """``n`` samples of 3 tokens at temperature 0.8 from one prompt. With ``trees``, ``n``
    more in the same batch that ask for logprobs (so they draft chains beside the trees:
    ``"chain_tokens"``) and the worker's tree counters (needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1)."""
    from vllm import SamplingParams

    llm = _llm(ckpt, k, fields=fields, max_model_len=256)
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
    batch = [params] * n
    if trees:
        batch += [SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, logprobs=0)] * n
    outs = llm.generate(["The colour of the sky is"] * len(batch), batch, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"tokens": tokens[:n]}
    if trees:
        from vllm_specstream.model_executor.trees.step import tree_stats

        result["chain_tokens"] = tokens[n:]
        result["trees"] = llm.apply_model(tree_stats)[0]
    return result


def plain_run(model: str, prompts: list[str], n: int, dtype: str = "float32") -> dict:
    """Greedy prompt + output tokens of a plain model, and whether the plugin registered in
    this (front-end) process."""
    from vllm import SamplingParams

    import vllm_specstream.patches.registration

    llm = _llm(model, max_model_len=512, dtype=dtype)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    return {
        "frontend_registered": vllm_specstream.patches.registration._registered,
        "tokens": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
    }


def reference(ckpt: str, k: int, requests: list[dict]) -> list[list[int]]:
    """Greedy outputs with the default (adaptive) speculation, a small KV cache."""
    from vllm import SamplingParams

    llm = _llm(ckpt, k, adaptive=True, max_model_len=512, kv_cache_memory_bytes=256 << 20)
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"]) for r in requests]
    outs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def lora_mixed(base: str, adapter: str, prompts: list[str], n: int) -> dict:
    """Greedy outputs under ``enable_lora`` (one slot) of ``prompts[0]`` with ``adapter`` batched
    with the others without one, then of the others alone; then the same again with vLLM's
    own CPU LoRA ops and linear-layer method put back (the engine runs in this process), to
    show what the patches fix."""
    from vllm import SamplingParams
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.lora.request import LoRARequest

    from vllm_specstream.patches.cpu_lora_ops import REPLACEMENTS

    originals = {name: getattr(lora_ops, name) for name in REPLACEMENTS}
    assert not any(originals[name] is fn for name, fn in REPLACEMENTS.items())
    llm = _llm(base, max_model_len=512, enable_lora=True, max_loras=1, max_lora_rank=8)
    assert all(getattr(lora_ops, name) is fn for name, fn in REPLACEMENTS.items())
    wrapper = punica_cpu.PunicaWrapperCPU
    assert getattr(wrapper.add_lora_linear, "__specstream_grouped__", False)
    params = SamplingParams(temperature=0.0, max_tokens=n)
    lora = LoRARequest("task", 1, adapter)

    def run() -> dict:
        mixed = llm.generate(
            prompts, params, lora_request=[lora] + [None] * (len(prompts) - 1), use_tqdm=False
        )
        alone = llm.generate(prompts[1:], params, use_tqdm=False)
        return {
            "mixed": [list(o.outputs[0].token_ids) for o in mixed],
            "alone": [list(o.outputs[0].token_ids) for o in alone],
        }

    patched = run()
    for module in (lora_ops, punica_cpu):
        for name, fn in originals.items():
            setattr(module, name, fn)
    wrapper.add_lora_linear = wrapper.add_lora_linear.__wrapped__
    return {"patched": patched, "unpatched": run()}


def lora_stash(ckpt: str, k: int, engine: dict, requests: list[dict]) -> list[dict]:
    """Each request decoded alone (``"lora"``: an adapter directory), drafting ``k`` at every
    step; its prompt and output tokens and the model's last stash (the streams' drafts of
    the last forward; none without speculation)."""
    from vllm import SamplingParams

    from vllm_specstream.model_executor.specstream import stash_snapshot

    llm = _llm(ckpt, k, **engine)  # ``engine`` may name the stream ``placement``
    loras = _lora_requests(requests).get("lora_request", [None] * len(requests))
    out = []
    for request, lora in zip(requests, loras):
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
        o = llm.generate([request["prompt"]], params, lora_request=lora, use_tqdm=False)[0]
        out.append(
            {
                "prompt_ids": [list(o.prompt_token_ids)],
                "tokens": [list(o.outputs[0].token_ids)],
                "stash": llm.apply_model(stash_snapshot)[0] if k else None,
            }
        )
    return out


def python(code: str, cwd: str) -> None:
    """``python -c CODE`` in ``cwd``: a script that checks vLLM's internals in a process of
    its own (patches applied there stay there)."""
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


CHILDREN = {
    f.__name__: f
    for f in (
        generate,
        features,
        probe,
        fail_to_start,
        sample,
        plain_run,
        reference,
        lora_mixed,
        lora_stash,
        python,
    )
}


def run_child(
    name: str,
    *,
    env=None,
    timeout: int = 900,
    check: bool = True,
    processes: bool = False,
    **args,
):
    """Run ``name(**args)`` in a child process. Returns ``(result, completed process)``;
    with ``check``, a failed child fails the test with the end of its stderr. The engine
    runs in that process (:data:`IN_PROCESS_ENV`) unless ``processes`` or tensor
    parallelism asks for vLLM's own processes."""
    engine = args.get("engine") or {}
    ranks = engine.get("tensor_parallel_size", 1) * engine.get("pipeline_parallel_size", 1)
    layout = {} if processes or ranks > 1 else IN_PROCESS_ENV
    environ = {**os.environ, **layout, **(env or {})}
    server = ForkServer.shared() if layout else None
    if server is not None and server.can_run(environ, {**layout, **(env or {})}):
        out = server.run(name, args, environ, timeout)
    else:
        out = subprocess.run(
            [sys.executable, CHILD, name, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environ,
        )
    if check:
        assert out.returncode == 0, out.stderr[-6000:]
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    return (json.loads(line[len("RESULT ") :]) if line else None), out


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``helpers.run_python`` (``code`` in a process of its own, from ``tests/``), started
    from the fork server where ``env`` allows: vLLM is then imported already, the plugin
    not."""
    return run_child("python", env=env, check=False, code=code, cwd=str(Path(CHILD).parents[1]))[1]


class ForkServer:
    """A process that imports vLLM, PyTorch and Transformers once, then forks one child per
    run: the child takes the run's environment and output files and runs its program with
    the engine in its own process, as a fresh ``python engine_child.py NAME ARGS`` would.

    Only vLLM and its dependencies are imported before the fork, not the plugin: its
    registration and patches happen in each child as in a user's process. A run whose
    environment differs from the server's in a variable that may be read on import (e.g.
    ``VLLM_LOGGING_LEVEL``, ``ONEDNN_MAX_CPU_ISA``) runs in a fresh process instead."""

    #: Variables read when an engine starts, not when vLLM or PyTorch is imported (pytest
    #: names the running test in PYTEST_CURRENT_TEST: a server started by one test serves
    #: the next ones).
    FORK_SAFE = frozenset(
        {
            "VLLM_ALLOW_INSECURE_SERIALIZATION",
            "VLLM_CPU_OMP_THREADS_BIND",
            "PYTHONUNBUFFERED",
            "PYTEST_CURRENT_TEST",
        }
    )
    #: The plugin's own variables: the plugin is imported only in the child, never the server.
    FORK_SAFE_PREFIX = "SPECSTREAM_"
    _shared: ForkServer | None = None

    def __init__(self) -> None:
        self.environ = {**os.environ, **IN_PROCESS_ENV}
        self.log = tempfile.NamedTemporaryFile(prefix="fork-server-", suffix=".log")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, CHILD, "--fork-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            bufsize=0,
            env=self.environ,
        )
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> ForkServer | None:
        """This process's server (started on first use); None where ``fork`` is missing."""
        if not hasattr(os, "fork"):
            return None
        if cls._shared is None or cls._shared.process.poll() is not None:
            cls._shared = cls()
        return cls._shared

    def can_run(self, environ: dict, asked: dict) -> bool:
        """Whether a run in ``environ`` (with the variables ``asked`` for it) may fork: it
        differs from the server's environment only in :data:`FORK_SAFE`, in variables named
        with :data:`FORK_SAFE_PREFIX` and in variables that imports in the test process added
        (vLLM and its dependencies set some when imported, as in the server)."""
        for k in set(environ) | set(self.environ):
            value = environ.get(k)
            if value == self.environ.get(k):
                continue
            if k in self.FORK_SAFE or k.startswith(self.FORK_SAFE_PREFIX):
                continue
            if k in asked or k in self.environ:
                return False
        return True

    def run(self, name: str, args: dict, environ: dict, timeout: float):
        with tempfile.TemporaryDirectory(prefix="engine-child-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"name": name, "args": args, "environ": environ}
            request |= {"stdout": str(out), "stderr": str(err)}
            data = (json.dumps(request) + "\n").encode()
            while data:  # an unbuffered pipe may take a long request in parts
                data = data[self.process.stdin.write(data) :]
            pid = self._reply()["pid"]
            # The child's exit status is the server's next line.
            done = self._reply(timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self._reply()
                raise subprocess.TimeoutExpired([CHILD, name], timeout)
            return subprocess.CompletedProcess(
                [CHILD, name], done["returncode"], out.read_text(), err.read_text()
            )

    def _reply(self, timeout: float | None = None) -> dict | None:
        """The server's next line (None if none came within ``timeout`` seconds), read from
        the pipe itself: a buffered reader could hold a line that ``select`` cannot see."""
        fd = self.process.stdout.fileno()
        line = b""
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], timeout)[0]:
                return None
            byte = os.read(fd, 1)
            if not byte:
                log = Path(self.log.name).read_text()[-4000:]
                raise RuntimeError(f"the engine tests' fork server died:\n{log}")
            line += byte
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


def _serve_forks() -> None:
    """The server side of :class:`ForkServer`: one request per stdin line."""
    # The replies go to a copy of stdout; anything printed on import goes to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            protocol.close()
            _forked_child(request)
        protocol.write(json.dumps({"pid": pid}) + "\n")
        protocol.flush()
        _, status = os.waitpid(pid, 0)
        protocol.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        protocol.flush()


def _forked_child(request: dict) -> None:
    """A forked child: the run's environment and output files, its program; never returns."""
    os.environ.clear()
    os.environ.update(request["environ"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    code = 0
    try:
        run(request["name"], request["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(name: str, args: dict) -> None:
    result = CHILDREN[name](**args)
    if result is not None:
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
        sys.stdout.flush()


def main() -> None:
    if sys.argv[1] == "--fork-server":
        _serve_forks()
    else:
        run(sys.argv[1], json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
