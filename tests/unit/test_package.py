"""Packaging: entry point, console script, lazy imports, --help everywhere."""

import subprocess
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from helpers import run_python, venv_script

SPECSTREAM = venv_script("specstream")


def test_plugin_entry_point_is_discovered():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vllm_specstream"]
    assert len(eps) == 1
    assert eps[0].value == "vllm_specstream.patches.registration:register"
    from vllm_specstream.patches.registration import register

    assert eps[0].load() is register


def test_import_is_lazy():
    out = run_python(
        "import sys, vllm_specstream, vllm_specstream.cli, vllm_specstream.patches.registration\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(heavy)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_training_never_imports_vllm():
    # Every training module imports without vLLM (training runs where vLLM is not installed);
    # only writing replies with vLLM (training/replies.py) imports it, when it runs.
    out = run_python(
        "import importlib, pkgutil, sys, vllm_specstream.training as t\n"
        "for m in pkgutil.walk_packages(t.__path__, t.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('vllm' in sys.modules)"
    )
    assert out.stdout.strip() == "False", out.stderr


def test_layout_keeps_its_import_rules():
    # The contracts of pyproject.toml's [tool.importlinter] (docs/architecture.md): no cycles,
    # vLLM only where it runs, folders importing only the layers below them.
    out = subprocess.run(
        [venv_script("lint-imports"), "--no-cache"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr


@pytest.mark.parametrize("sub", [[], ["prepare-base"], ["install-vllm-cli"], ["doctor"]])
def test_help(sub):
    out = subprocess.run([SPECSTREAM, *sub, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage: specstream" in out.stdout


def test_no_subcommand_prints_help_and_fails():
    out = subprocess.run([SPECSTREAM], capture_output=True, text=True)
    assert out.returncode == 2 and "prepare-base" in out.stdout
