"""Reference-decoder tokens per step by draft-vocabulary size, on a task's held-out split.

Loads an adapter once, builds each draft vocabulary as ``specstream draft-vocab`` would
(from the training split of ``--data``) and decodes the same held-out prompts with the
chain decoder for each size (0: the whole vocabulary). Outputs are the same for every size
(drafts are verified); only the tokens per step can change. Prints a table, writes JSON.

    .venv/bin/python benchmarks/draft_vocab_sweep.py ADAPTER --task e2e --data FILE
        [--sizes 0,4096,8192,16384] [-n 40] [--out benchmarks/results/draft-vocab]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_specstream.draft_vocab import draft_vocab_mask
from vllm_specstream.machine import describe_machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("adapter")
    ap.add_argument("--task", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--sizes", default="0,4096,8192,16384")
    ap.add_argument("-n", type=int, default=40, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/draft-vocab")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_specstream.training.checkpoint import load_adapter
    from vllm_specstream.training.draft_vocab import task_tokens
    from vllm_specstream.training.evaluate import eval_cases, evaluate_checkpoint

    torch.set_num_threads(2)
    model = load_adapter(args.adapter)
    tok = AutoTokenizer.from_pretrained(model.config.base_model)
    vocab = model.lm_head(torch.zeros(1, model.stream_embeddings.shape[-1])).shape[-1]
    tokens = task_tokens(tok, args.task, args.data)
    cases = eval_cases(args.task, None, args.n, data=args.data, split="val")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        if size:
            ids = tokens.draft_vocab_ids(vocab, size)
            model.draft_vocab_mask = torch.nn.Parameter(draft_vocab_mask(ids, vocab), False)
        else:
            model.draft_vocab_mask = None
        result = evaluate_checkpoint(
            model, tok, args.task, cases, args.max_new_tokens, tree_top_k=1, progress=False
        )
        rows.append({"size": size or vocab, **result})
        print(
            f"{args.task} size {size or vocab:6d}: chain {result['tokens_per_step']['chain']:.3f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": describe_machine(),
        "adapter": args.adapter,
        "prompts": len(cases),
        "rows": rows,
    }
    (out / f"{args.task}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
