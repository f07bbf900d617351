"""Speculative streaming end to end on the embedded SmolLM2-135M-Instruct, on a real task.

Merges a committed real-task adapter (``examples/adapters/``; default: E2E NLG, else Spider
SQL) onto the embedded model (cached; seconds when done before), then answers hand-written
prompts of the adapter's task with plain vLLM and with specstream on the same checkpoint,
batch 1, greedy, each engine started as the README starts one (``LLM(model=...)``, vLLM's
defaults). The screen shows the prompts, both outputs, tokens/s (median of 3 rounds), the
speedup, vLLM's tokens per step and whether the outputs are token-identical; vLLM's own
output goes to a log file whose path is printed.

    .venv/bin/python examples/demo.py [--adapter DIR] [--k 4] [--rounds 3] [--log FILE]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ADAPTERS = Path(__file__).parent / "adapters"
#: The demo's adapter: the first of these that is committed (real-task adapters only).
PREFERRED = ("e2e-smollm2-ss4", "sql-spider-smollm2-ss4")
DEFAULT_ADAPTER = next(
    (ADAPTERS / name for name in PREFERRED if (ADAPTERS / name).is_dir()), ADAPTERS / PREFERRED[-1]
)

#: Hand-written inputs in each task's public format (none is a dataset record).
PROMPTS = {
    "e2e": [
        # The venues of the E2E task's domain (names and attribute values), in combinations
        # of our own; invented venue names are words the task never teaches.
        "name[The Punter], eatType[coffee shop], food[Italian], priceRange[cheap], "
        "customer rating[5 out of 5], area[riverside], familyFriendly[yes], near[Café Sicilia]",
        "name[Zizzi], eatType[restaurant], food[Indian], priceRange[moderate], "
        "area[city centre], familyFriendly[no]",
        "name[The Golden Curry], eatType[pub], food[Fast food], customer rating[average], "
        "area[riverside], near[The Bakers]",
        "name[Loch Fyne], food[Chinese], priceRange[high], customer rating[1 out of 5]",
        "name[The Waterman], eatType[restaurant], food[English], priceRange[less than £20], "
        "area[city centre], familyFriendly[yes], near[Raja Indian Cuisine]",
    ],
    "sql": [
        (
            "CREATE TABLE author (Author_ID INTEGER, Name VARCHAR, Country VARCHAR); "
            "CREATE TABLE book (Book_ID INTEGER, Title VARCHAR, Author_ID INTEGER, "
            "Year INTEGER, Pages INTEGER)",
            question,
        )
        for question in (
            "How many books were published after 2000?",
            "What are the titles of books written by authors from France?",
            "Show the name of each author and the number of books they wrote.",
            "What is the average number of pages of books published in 1999?",
            "List the titles of the three longest books.",
        )
    ],
    "dialogsum": [
        "#Person1#: Hi, I'd like to return these shoes. They are too small.\n"
        "#Person2#: Do you have the receipt?\n#Person1#: Yes, here it is.\n"
        "#Person2#: Would you like a larger size or your money back?\n"
        "#Person1#: A larger size, please.",
        "#Person1#: Are you coming to the meeting at three?\n"
        "#Person2#: I can't, I have to pick up my daughter from school.\n"
        "#Person1#: Then I'll send you the notes tonight.\n#Person2#: Thanks, that helps.",
    ],
}


#: vLLM serves an fp32 checkpoint in bf16 on a CPU with native bf16 (dtype "auto"), and its
#: bf16 kernels round a row differently in batches of other sizes: a verified draft may then
#: flip a near-tie, as with any speculative method. In fp32 every output is identical.
BF16_NOTE = (
    " (served in bf16, vLLM's choice on this CPU: a step verifying drafts rounds differently "
    "from a plain one, so a near-tie may flip; in float32 every output is identical)"
)


def merged_checkpoint(adapter: Path, screen) -> Path:
    """``adapter`` merged onto the embedded model, cached by the adapter's content."""
    from vllm_specstream.paths import specstream_home

    digest = hashlib.sha256()
    for name in ("adapter_model.safetensors", "specstream.safetensors", "specstream_config.json"):
        digest.update((adapter / name).read_bytes())
    out = specstream_home() / "demo" / f"{adapter.name}-{digest.hexdigest()[:12]}"
    if not (out / "config.json").is_file():  # export writes to a .partial dir, renamed last
        screen.write(f"  merging {adapter} onto the embedded model -> {out}\n")
        # In a process of its own: vLLM's CPU engine reserves 92% of the machine's memory by
        # default, which a front-end still holding the merged model would not leave it.
        # fp32 weights: vLLM serves them in fp32, or in bf16 where the CPU has native bf16.
        export = [sys.executable, "-m", "vllm_specstream.cli", "export", str(adapter), str(out)]
        subprocess.run([*export, "--dtype", "float32"], check=True)
    return out


def task_prompts(task: str) -> list[str]:
    from vllm_specstream.training.tasks.public import dialogsum_prompt, e2e_prompt, sql_prompt

    if task == "e2e":
        return [e2e_prompt(mr) for mr in PROMPTS["e2e"]]
    if task == "sql":
        return [sql_prompt(context, question) for context, question in PROMPTS["sql"]]
    if task == "dialogsum":
        return [dialogsum_prompt(dialogue) for dialogue in PROMPTS["dialogsum"]]
    raise SystemExit(f"the demo has no prompts for task {task!r} (train_args.json of the adapter)")


def generate(checkpoint: Path, prompts: list[str], k: int, max_tokens: int, rounds: int) -> dict:
    """The prompts one at a time (batch 1, greedy), ``rounds`` times, on an engine started as
    the README starts one: ``LLM(model=...)``, with ``speculative_config(k)`` where ``k``."""
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config

    kw = {"speculative_config": speculative_config(k)} if k else {}
    llm = LLM(model=str(checkpoint), disable_log_stats=False, **kw)  # stats: tokens per step
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    counters = _spec_counters(llm)
    rates, outputs = [], []
    for _ in range(rounds):
        count, seconds = 0, 0.0
        for prompt in prompts:
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - start
            count += len(out.token_ids)
            outputs.append(out)
        rates.append(count / seconds)
    drafts, accepted = (b - a for a, b in zip(counters, _spec_counters(llm)))
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    first = outputs[: len(prompts)]
    return {
        "texts": [o.text.strip() for o in first],
        "tokens": [list(o.token_ids) for o in first],
        "rates": rates,
        "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
        "dtype": dtype,
    }


def _spec_counters(llm) -> tuple[int, int]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (
        values.get("vllm:spec_decode_num_drafts", 0),
        values.get("vllm:spec_decode_num_accepted_tokens", 0),
    )


def _shown(prompt: str, width: int = 100) -> str:
    body = prompt.split("\n", 1)[-1].replace("\n", " / ")
    return body if len(body) <= width else body[: width - 3] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--adapter", type=Path, default=DEFAULT_ADAPTER, help="a committed specstream adapter"
    )
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts per engine")
    parser.add_argument("--log", type=Path, help="vLLM's log (default: SPECSTREAM_HOME/logs)")
    args = parser.parse_args()

    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.bench.engine_log import default_log, output_to

    args_file = args.adapter / "train_args.json"
    if not args_file.is_file():
        sys.exit(f"--adapter {args.adapter}: no train_args.json (not a specstream adapter?)")
    task = json.loads(args_file.read_text())["task"]
    log = args.log or default_log("demo")
    print(f"Speculative streaming demo: {args.adapter.name} ({task}) on SmolLM2-135M-Instruct")
    print(f"vLLM's log: {log}")
    with output_to(log) as screen:
        try:
            prepare_base()
            checkpoint = merged_checkpoint(args.adapter, screen)
            from transformers import AutoTokenizer

            from vllm_specstream.training.data import prompt_text

            tok = AutoTokenizer.from_pretrained(checkpoint)
            prompts = task_prompts(task)
            chats = [prompt_text(tok, [{"role": "user", "content": p}]) for p in prompts]
            runs = {}
            for name, k in (("plain vLLM", 0), (f"specstream (k={args.k})", args.k)):
                screen.write(
                    f"  {name}: starting the engine (vLLM compiles the model first), "
                    f"{args.rounds} rounds of {len(prompts)} prompts ...\n"
                )
                runs[name] = generate(checkpoint, chats, k, args.max_tokens, args.rounds)
        except BaseException:
            screen.write(f"failed; the cause is at the end of {log}\n")
            raise
    (plain_name, plain), (spec_name, spec) = runs.items()
    for i, prompt in enumerate(prompts):
        same = plain["tokens"][i] == spec["tokens"][i]
        print(f"\n### {_shown(prompt)}")
        print(f"  plain      : {plain['texts'][i]}")
        print(f"  specstream : {spec['texts'][i]}   [{'identical' if same else 'DIFFERENT'}]")
    identical = sum(a == b for a, b in zip(plain["tokens"], spec["tokens"]))
    plain_rate, spec_rate = (statistics.median(r["rates"]) for r in (plain, spec))
    ratios = sorted(s / p for s, p in zip(spec["rates"], plain["rates"]))
    print(
        f"\nbatch 1, greedy, {len(prompts)} prompts, median of {args.rounds} rounds (tokens/s):\n"
        f"  {plain_name:<18} {plain_rate:6.2f} tokens/s\n"
        f"  {spec_name:<18} {spec_rate:6.2f} tokens/s   "
        f"speedup {spec_rate / plain_rate:.2f}x (rounds {ratios[0]:.2f}x-{ratios[-1]:.2f}x)   "
        f"tokens per step {spec['tokens_per_step']:.2f}\n"
        f"  outputs token-identical: {identical} of {len(prompts)}"
        f"{BF16_NOTE if spec['dtype'] == 'bfloat16' else ''}\n"
        f"vLLM's log: {log}"
    )


if __name__ == "__main__":
    main()
