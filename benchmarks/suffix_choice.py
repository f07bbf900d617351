"""Which draft to verify, step by step: the streams', or the suffix trees' (batch 1, greedy).

Runs a specstream engine in this process with suffix trees kept beside the streams but never
chosen (field ``suffix_drafts: inf``), so the streams draft every step, and records at
each proposer call both drafts and the suffix draft's score. Greedy decoding with
speculation gives plain decoding's tokens, so each draft's accepted length is read off the
final output afterwards. Prints, per rule, tokens per step, the share of steps that skip the
stream pass (suffix chosen) and a modelled decode speedup from step costs relative to a plain
step (``--stream-step``: a step that ran the stream pass; ``--suffix-step``: one that did
not): the streams alone, suffix alone, suffix where its score reaches a threshold, and an
oracle. The steps are the streams' trajectory; a rule's own trajectory visits other
positions, so this ranks rules and picks a threshold on a validation split, while
``specstream bench --methods specstream,specstream-suffix`` measures the chosen one.

    .venv/bin/python benchmarks/suffix_choice.py CKPT --task sql --data FILE [-n 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)


def accepted(draft: list[int], seq: list[int], at: int) -> int:
    """How many of ``draft`` match ``seq`` from position ``at`` (greedy verification)."""
    n = 0
    for j, t in enumerate(draft):
        if at + j >= len(seq) or seq[at + j] != t:
            break
        n += 1
    return n


def rules(steps: list[dict], stream_step: float, suffix_step: float) -> list[dict]:
    """Tokens per step, suffix share and modelled decode speedup of each rule over ``steps``
    (each: ``stream`` and ``suffix`` accepted lengths, suffix ``score`` and whether it drafted)."""

    def rule(name: str, take_suffix) -> dict:
        tokens = cost = 0.0
        chosen = 0
        for s in steps:
            use = take_suffix(s)
            chosen += use
            tokens += 1 + (s["suffix"] if use else s["stream"])
            cost += suffix_step if use else stream_step
        n = max(len(steps), 1)
        return {
            "rule": name,
            "tokens_per_step": tokens / n,
            "suffix_share": chosen / n,
            "decode_speedup": tokens / cost if cost else 0.0,
        }

    out = [rule("streams", lambda s: False), rule("suffix only", lambda s: s["has_suffix"])]
    # ``on``: suffix where 1 + score tokens at a suffix step's cost match the streams' yield.
    mean_stream = statistics.fmean(s["stream"] for s in steps) if steps else 0.0
    on = max((1.0 + mean_stream) / stream_step * suffix_step - 1.0, 0.0)
    out.append(rule(f"on (score >= {on:.2f})", lambda s: s["has_suffix"] and s["score"] >= on))
    for t in THRESHOLDS:
        out.append(rule(f"score >= {t:g}", lambda s, t=t: s["has_suffix"] and s["score"] >= t))
    out.append(rule("oracle", lambda s: s["has_suffix"] and s["suffix"] >= s["stream"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--task", default="sql")
    ap.add_argument("--data", required=True)
    ap.add_argument("--split", default="val")
    ap.add_argument("-n", type=int, default=32, help="prompts, decoded one at a time")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--stream-step", type=float, default=1.24, help="plain steps per stream step")
    ap.add_argument("--suffix-step", type=float, default=1.02, help="plain steps per suffix step")
    ap.add_argument("--json", help="write the steps and the rules' figures here")
    args = ap.parse_args()

    from profile_step import preload_iomp_and_reexec, task_prompts_cycled

    preload_iomp_and_reexec()
    from vllm import LLM, SamplingParams

    from vllm_specstream import speculative_config
    from vllm_specstream.cpu_env import cpu_engine_kwargs
    from vllm_specstream.proposer import SpecStreamProposer
    from vllm_specstream.suffix_drafts import SuffixDrafts

    calls: list[dict] = []
    suffix_of: dict[tuple[str, int], tuple[list[int], float]] = {}
    draft = SuffixDrafts.draft

    def recorded_draft(self, req_id, row_tokens, num_tokens, k):
        d = draft(self, req_id, row_tokens, num_tokens, k)
        suffix_of[(req_id, num_tokens)] = (d.tokens, d.score)
        return d

    propose = SpecStreamProposer.propose

    def recorded_propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *a, **kw):
        drafts = propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *a, **kw)
        runner = self._runner()
        for r, d in enumerate(drafts):
            if sampled_token_ids[r]:
                req = runner.input_batch.req_ids[r]
                calls.append({"req": req, "at": int(num_tokens_no_spec[r]), "stream": list(d)})
        return drafts

    SuffixDrafts.draft = recorded_draft
    SpecStreamProposer.propose = recorded_propose

    prompts = task_prompts_cycled(args.ckpt, args.task, args.data, args.split, args.n)
    kw = cpu_engine_kwargs(dtype="float32")
    kw["speculative_config"] = speculative_config(args.k)
    kw["additional_config"] = {"specstream": {"suffix_drafts": "inf"}}
    llm = LLM(model=args.ckpt, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(["Count from one to twenty."], params, use_tqdm=False)
    calls.clear()
    sequences: dict[str, list[int]] = {}
    order: list[str] = []
    for prompt in prompts:
        before = {c["req"] for c in calls}
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        for req in {c["req"] for c in calls} - before:
            sequences[req] = seq
            order.append(req)
    steps = []
    index = {req: i for i, req in enumerate(order)}
    for c in calls:
        seq = sequences.get(c["req"])
        if seq is None or c["at"] >= len(seq):
            continue
        tokens, score = suffix_of.get((c["req"], c["at"]), ([], 0.0))
        steps.append(
            {
                "stream": accepted(c["stream"], seq, c["at"]),
                "suffix": accepted(tokens, seq, c["at"]),
                "score": score,
                "has_suffix": bool(tokens),
                "request": index[c["req"]],
            }
        )
    table = rules(steps, args.stream_step, args.suffix_step)
    print(f"{len(steps)} decode steps over {len(order)} requests ({args.task}, {args.split})")
    print(
        f"step costs (plain = 1): stream {args.stream_step:g}, suffix {args.suffix_step:g}\n"
        "| rule | tokens/step | suffix share | modelled decode speedup |\n|---|---|---|---|"
    )
    for r in table:
        print(
            f"| {r['rule']} | {r['tokens_per_step']:.2f} | {r['suffix_share']:.2f} | "
            f"{r['decode_speedup']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rules": table, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
