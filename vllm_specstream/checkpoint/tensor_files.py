"""Reading a checkpoint's safetensors files with errors that name the file."""

from __future__ import annotations

from pathlib import Path

from vllm_specstream.checkpoint.config import ConfigError


def read_tensors(path: str | Path) -> dict:
    """All tensors of the safetensors file ``path``; a missing, truncated or damaged file is
    a :class:`ConfigError` that names it (safetensors' own error names no file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{path}: not a readable safetensors file ({e}); it is truncated or damaged: "
            "copy it again, or write it again with the command that made it"
        ) from None
