"""Where and in which precision a run trains."""

from __future__ import annotations

import torch

from vllm_specstream.checkpoint.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """The device of ``--device`` (``auto``: a CUDA GPU when PyTorch sees one); a bad one is a
    :class:`ConfigError`, which the CLI shows as one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name}: PyTorch {torch.__version__} sees no CUDA GPU; "
            "use --device cpu (or auto)"
        )
    return device


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """The training precision of ``--dtype`` on ``device`` (default: the CPU)."""
    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    if name == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16
        from vllm_specstream.machine import native_bf16

        fast_bf16 = torch.backends.mkldnn.is_available() and native_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    raise ValueError(f"--dtype must be bf16, fp32 or auto, got {name!r}")


def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen linear weight in ``dtype`` once, for training under autocast to it:
    autocast keeps its casts of trainable weights only, so a frozen fp32 weight was cast
    again at every call (the tied LM head, 28M values, once per stream per step). The
    products are the same. A weight shared with an embedding (a tied LM head) gets its own
    copy, so embeddings stay in full precision. Returns how many weights were cast."""
    cast = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for name in ("weight", "bias"):
            param = getattr(module, name)
            if param is None or param.requires_grad or param.dtype == dtype:
                continue
            setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
            cast += 1
    return cast


def describe_device(device: torch.device) -> str:
    """The machine a run trains on, for its model card: the GPU's name, or the CPU's."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA)"
    from vllm_specstream.machine import describe_machine

    return describe_machine()


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with its tensors on ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
