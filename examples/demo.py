"""Generate with vLLM on the embedded SmolLM2-135M-Instruct and print text and tokens/s.

.venv/bin/python examples/demo.py [--model DIR] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", help="bfloat16 or float32 (default: picked for this CPU)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_specstream.base_model import prepare_base
    from vllm_specstream.cpu_env import cpu_engine_kwargs

    model = args.model or str(prepare_base())
    llm = LLM(model=model, **cpu_engine_kwargs(**({"dtype": args.dtype} if args.dtype else {})))
    prompts = [
        "Write a SQL query that lists the names of employees hired after 2020.",
        "Explain in two sentences what a hash table is.",
        "Write a Python function that reverses a string.",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(messages[:1], params, use_tqdm=False)  # warm-up
    for conversation in messages:
        start = time.perf_counter()
        out = llm.chat([conversation], params, use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - start
        print(f"\n### {conversation[0]['content']}\n{out.text.strip()}")
        print(
            f"[{len(out.token_ids)} tokens in {elapsed:.2f} s: "
            f"{len(out.token_ids) / elapsed:.1f} tokens/s, batch 1, plain vLLM]"
        )


if __name__ == "__main__":
    main()
