"""Speculative streaming end to end on the embedded SmolLM2-135M-Instruct.

Merges the committed demo SQL adapter (``examples/adapters/sql-smollm2-ss4``) onto the
embedded model (cached; seconds when done before), then answers SQL test questions with
plain vLLM and with specstream on the same checkpoint, batch 1, greedy, and prints the
queries, tokens/s, the speedup, vLLM's tokens per step and whether the outputs are identical.

    .venv/bin/python examples/demo.py [--checkpoint MERGED_DIR] [-n 5] [--k 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time
from pathlib import Path

DEMO_ADAPTER = Path(__file__).parent / "adapters" / "sql-smollm2-ss4"


def merged_demo_checkpoint() -> Path:
    """The demo adapter merged onto the embedded model, cached by the adapter's content."""
    from vllm_specstream.paths import specstream_home
    from vllm_specstream.training.checkpoint import export_merged

    digest = hashlib.sha256()
    for name in ("adapter_model.safetensors", "specstream.safetensors", "specstream_config.json"):
        digest.update((DEMO_ADAPTER / name).read_bytes())
    out = specstream_home() / "demo" / f"sql-smollm2-ss4-{digest.hexdigest()[:12]}"
    if not (out / "config.json").is_file():  # export writes to a .partial dir, renamed last
        print(f"Merging {DEMO_ADAPTER} onto the embedded model -> {out}")
        export_merged(DEMO_ADAPTER, out)
    return out


def generate(checkpoint: Path, prompts: list[str], dtype: str, k: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs

    kw = cpu_engine_kwargs(dtype=dtype)
    if k:
        kw["speculative_config"] = speculative_config(k)
    llm = LLM(model=str(checkpoint), disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    counters = _spec_counters(llm)
    texts, tokens, rates = [], [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - start))
        texts.append(out.text.strip())
        tokens.append(list(out.token_ids))
    drafts, accepted = (b - a for a, b in zip(counters, _spec_counters(llm)))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {
        "texts": texts,
        "tokens": tokens,
        "tok_s": statistics.median(rates),
        "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
    }


def _spec_counters(llm) -> tuple[int, int]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (
        values.get("vllm:spec_decode_num_drafts", 0),
        values.get("vllm:spec_decode_num_accepted_tokens", 0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a merged specstream checkpoint (default: the demo)")
    parser.add_argument("-n", type=int, default=5, help="SQL test questions")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default: fastest for speculation on CPUs without native bf16) or bfloat16",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.training.data import prompt_text
    from vllm_specstream.training.tasks import build_task, to_example

    prepare_base()
    checkpoint = Path(args.checkpoint) if args.checkpoint else merged_demo_checkpoint()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    records = build_task("sql", "test", n=args.n)
    prompts = [prompt_text(tok, to_example("sql", r).messages) for r in records]
    plain = generate(checkpoint, prompts, args.dtype, 0, args.max_tokens)
    spec = generate(checkpoint, prompts, args.dtype, args.k, args.max_tokens)
    for record, text in zip(records, spec["texts"]):
        print(f"\n### {record['question']}\n{text}")
    print(
        f"\nbatch 1, greedy, {args.dtype}, {len(prompts)} questions (median tokens/s):\n"
        f"  plain vLLM        {plain['tok_s']:6.2f} tokens/s\n"
        f"  specstream (k={args.k})  {spec['tok_s']:6.2f} tokens/s   "
        f"speedup {spec['tok_s'] / plain['tok_s']:.2f}x   "
        f"tokens per step {spec['tokens_per_step']:.2f}\n"
        f"  outputs identical: {spec['tokens'] == plain['tokens']}"
    )


if __name__ == "__main__":
    main()
