"""`specstream deploy`: check adapters can share one server; print its command."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_deploy(args: argparse.Namespace) -> int:
    from vllm_specstream.checkpoint.deployment import plan_deployment

    adapters = {}
    for item in args.adapters:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"specstream deploy: error: {item!r} is not NAME=DIR", file=sys.stderr)
            return 2
        adapters[name] = path
    plan = plan_deployment(args.base, adapters)
    if args.overrides:
        print(json.dumps(plan.overrides()))
    else:
        print(plan.serve_command(args.spec_tokens))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "deploy",
        help="the vllm serve command for one base and several specstream LoRA adapters",
        description="Check that specstream adapters (directories written by `specstream train`) "
        "can be served together on BASE, each request drafting with its own adapter's streams, "
        "and print the `vllm serve` command (the base served through --hf-overrides; adapters "
        "must share num_msa_layers).",
    )
    p.add_argument("base", help="base model directory (the adapters' base)")
    p.add_argument("adapters", nargs="+", metavar="NAME=DIR", help="adapter name and directory")
    p.add_argument("--spec-tokens", type=int, help="drafts per step (default: fewest streams)")
    p.add_argument(
        "--overrides", action="store_true", help="print only the hf_overrides JSON (for LLM(...))"
    )
    p.set_defaults(func=_cmd_deploy)
