"""`specstream export`: merge an adapter into its base, the checkpoint vLLM serves."""

from __future__ import annotations

import argparse
import json


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from vllm_specstream.training.checkpoint import export_merged

    out = export_merged(
        args.adapter_dir,
        args.out_dir,
        base=args.base,
        dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype],
        suffix_drafts=args.suffix_drafts,
    )
    print(f"Merged checkpoint written: {out}")
    suffix = json.loads((out / "config.json").read_text())["specstream"].get("suffix_drafts")
    if suffix:
        print(
            f"Serves with suffix drafts beside the streams by default ({suffix}; needs "
            "arctic-inference: make suffix-decoding; the engine field suffix_drafts=off turns them "
            'off: --additional-config \'{"specstream": {"suffix_drafts": "off"}}\')'
        )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="merge an adapter into its base: the checkpoint vLLM serves",
        description="Write a merged checkpoint: LoRA merged into the base weights, the stream "
        "tensors in specstream.safetensors, config.json with architectures "
        "['SpecStreamForCausalLM'] and a 'specstream' section. OUT_DIR must be new, empty or "
        "an earlier export (which it replaces); the checkpoint is written beside it and renamed "
        "into place, so a failed export leaves OUT_DIR as it was.",
    )
    p.add_argument("adapter_dir", help="the adapter `specstream train` wrote")
    p.add_argument("out_dir", help="where the merged checkpoint goes")
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge LoRA into the weights: what export always does (accepted for older scripts)",
    )
    p.add_argument("--base", help="base model dir (default: the one recorded in the adapter)")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the weights' dtype (vLLM serves the checkpoint in it by default; float32 "
        "where outputs must equal an fp32 model's token for token) (default: %(default)s)",
    )
    p.add_argument(
        "--suffix-drafts",
        metavar="on|off|SCORE",
        help="the checkpoint's serving default of suffix drafts beside the streams "
        "(specstream.suffix_drafts; the engine field suffix_drafts overrides it at serving time): "
        "'on' where suffix-tree drafts were measured to pay on the task (they need "
        "arctic-inference; without it the streams draft alone), 'off' to clear it "
        "(default: the adapter's specstream_config.json)",
    )
    p.set_defaults(func=_cmd_export)
