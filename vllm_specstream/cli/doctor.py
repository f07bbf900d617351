"""`specstream doctor`: vLLM, the plugin and the base model, reported as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_specstream import __version__


def _cmd_doctor(args: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    from vllm_specstream.base_model import base_model_dir, verify_base_model
    from vllm_specstream.patches.cpu_env import find_iomp
    from vllm_specstream.patches.vllm_version import (
        UnsupportedVLLMVersion,
        ensure_supported_vllm,
        installed_vllm,
    )

    found = installed_vllm()
    try:
        ensure_supported_vllm()
        vllm_ok = "supported"
    except UnsupportedVLLMVersion as e:
        vllm_ok = str(e)
    plugins = [
        ep.value
        for ep in entry_points(group="vllm.general_plugins")
        if ep.value.startswith("vllm_specstream")
    ]
    problems = verify_base_model(base_model_dir())
    report = {
        "vllm_specstream": __version__,
        "python": sys.executable,
        "vllm": {"distribution": found[0], "version": found[1]} if found else None,
        "vllm_status": vllm_ok,
        "plugin_entry_point": plugins[0] if plugins else None,
        "intel_openmp": str(find_iomp()) if find_iomp() else None,
        "base_model": str(base_model_dir()),
        "base_model_status": "ok" if not problems else str(problems[0]),
    }
    print(json.dumps(report, indent=2))
    return 0 if found and vllm_ok == "supported" and plugins else 1


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="report vLLM, plugin and base-model status as JSON",
        description="Check the environment; exit 1 if vLLM or the plugin is unusable.",
    )
    p.set_defaults(func=_cmd_doctor)
