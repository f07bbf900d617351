"""Adapter and merged checkpoints (docs/checkpoint-format.md): build, save, load with checks, merge.

Adapter checkpoint (what ``specstream train`` writes)::

    specstream_config.json  adapter_config.json  adapter_model.safetensors  specstream.safetensors

Merged checkpoint (``specstream export``, what vLLM loads): the base model's files
with LoRA merged into the weights, ``specstream.safetensors`` holding the stream tensors
under ``specstream.*`` names, and ``config.json`` with ``architectures:
["SpecStreamForCausalLM"]`` plus a ``specstream`` section (the config fields and
``base_architectures``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_specstream.checkpoint.config import (
    CONFIG_FILE,
    MERGED_ARCHITECTURE,
    STREAM_FILE,
    STREAM_PREFIX,
    ConfigError,
    SpecStreamConfig,
    check_stream_tensors,
    projection_dims,
)
from vllm_specstream.checkpoint.families import family_of
from vllm_specstream.checkpoint.tensor_files import read_tensors
from vllm_specstream.safe_write import files_into, new_dir
from vllm_specstream.training.model import SpecStreamModel

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


@dataclass
class LoraSettings:
    """LoRA on the base model (PEFT)."""

    rank: int = 32
    """LoRA rank r."""
    alpha: float | None = None
    """LoRA alpha; None means 2 * rank."""
    target_modules: list[str] | None = None
    """Linear modules of each decoder layer that get LoRA; None: every projection of the
    base's family (:attr:`~vllm_specstream.checkpoint.families.BaseFamily.lora_targets`)."""
    layers: str = "all"
    """"all" decoder layers, "msa" (the top num_msa_layers only: cheaper backward), or a
    comma-separated list of layer indices."""
    dropout: float = 0.0


def lora_layer_indices(layers: str, num_layers: int, num_msa_layers: int) -> list[int] | None:
    if layers == "all":
        return None
    if layers == "msa":
        return list(range(num_layers - num_msa_layers, num_layers))
    try:
        return sorted({int(x) for x in layers.split(",")})
    except ValueError as e:
        raise ConfigError(
            f"--lora-layers: expected 'all', 'msa' or indices like '20,21', got {layers!r}"
        ) from e


def resolve_base(given: str | Path | None, recorded: str | None, where: Path) -> str:
    """The base model directory: ``given`` (``--base``), else the one the adapter records
    (``where``), or the embedded model when it names that (``base_model:
    "SmolLM2-135M-Instruct"``), converted on first use."""
    from vllm_specstream.base_model import MODEL_NAME, prepare_base

    base = given or recorded
    if base is None:
        raise ConfigError(f"{where}: base_model is not set; pass the base model path (--base)")
    if not Path(base).exists() and Path(base).name == MODEL_NAME:
        return str(prepare_base(progress=False))
    return check_model_dir(base, "--base" if given else f"{where}: base_model")


def check_model_dir(path: str | Path, what: str = "--base") -> str:
    """``path`` as a local model directory (one with ``config.json``): a model id or a
    missing directory is an error, never a download."""
    p = Path(path)
    if not (p / "config.json").is_file():
        problem = "not a model directory (no config.json)" if p.is_dir() else "no such directory"
        raise ConfigError(
            f"{what} {path}: {problem}; give the local directory of the base model "
            "(Hugging Face format; nothing is downloaded)"
        )
    return str(p)


def copy_tokenizer(dest: Path, *sources: Path) -> None:
    """Copy each of :data:`TOKENIZER_FILES` into ``dest`` from the first of ``sources``
    that holds it."""
    for name in TOKENIZER_FILES:
        source = next((d / name for d in sources if (d / name).is_file()), None)
        if source is not None:
            shutil.copy2(source, dest / name)


def base_config(base: str | Path):
    """The local base model's config, of a supported family."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(check_model_dir(base), local_files_only=True)
    family_of(hf_config, where=f"{base}/config.json")
    return hf_config


def load_base_lm(base: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    base_config(base)
    return AutoModelForCausalLM.from_pretrained(base, dtype=dtype, local_files_only=True)


def lora_targets(lora: LoraSettings, hf_config) -> list[str]:
    """The modules that get LoRA: as set, else every projection of the base's family."""
    if lora.target_modules is not None:
        return list(lora.target_modules)
    return list(family_of(hf_config).lora_targets)


def build_model(
    base: str | Path,
    config: SpecStreamConfig,
    lora: LoraSettings | None,
    dtype: torch.dtype = torch.float32,
    stream_init_std: float = 0.02,
) -> SpecStreamModel:
    """A trainable SpecStreamModel: base weights frozen, LoRA (if any) and streams trainable."""
    lm = load_base_lm(base, dtype)
    for p in lm.parameters():
        p.requires_grad_(False)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        n = lm.config.num_hidden_layers
        # Recorded as resolved (train_args.json, chain checks): the modules that trained.
        lora.target_modules = lora_targets(lora, lm.config)
        peft_config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha or 2 * lora.rank,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            layers_to_transform=lora_layer_indices(lora.layers, n, config.num_msa_layers),
            task_type="CAUSAL_LM",
        )
        lm = get_peft_model(lm, peft_config)
    config.base_model = str(base)
    return SpecStreamModel(lm, config, stream_init_std=stream_init_std)


#: The PEFT files vLLM reads from a LoRA directory (and ignores everything else in it).
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def null_lora(hf_config, base_model: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA that changes nothing (rank 1, B = 0, on the last layer's ``o_proj``):
    what a streams-only adapter gives vLLM's multi-LoRA serving, so that its requests get a
    LoRA slot (and with it the adapter's streams) while every main token stays the base
    model's (``y + 0``)."""
    last = hf_config.num_hidden_layers - 1
    d_in, d_out = projection_dims(hf_config)["o"]
    prefix = f"base_model.model.model.layers.{last}.self_attn.o_proj"
    tensors = {
        f"{prefix}.lora_A.weight": torch.zeros(1, d_in),
        f"{prefix}.lora_B.weight": torch.zeros(d_out, 1),
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 1,
        "lora_alpha": 1,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["o_proj"],
        "layers_to_transform": [last],
        "base_model_name_or_path": base_model,
    }
    return config, tensors


def save_adapter(model: SpecStreamModel, out_dir: str | Path) -> Path:
    """Write the adapter checkpoint files into ``out_dir`` (a streams-only adapter: with
    :func:`null_lora` as its PEFT files, for vLLM multi-LoRA), each written beside it and
    renamed into place (a run's directory also holds its records)."""
    out = Path(out_dir)
    with files_into(out) as tmp:
        model.config.save(tmp)
        if hasattr(model.lm, "save_pretrained") and hasattr(model.lm, "peft_config"):
            model.lm.save_pretrained(str(tmp))
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's stub: keep the run's card
        elif model.config.stream_lora_rank > 0:
            peft_config, peft_tensors = null_lora(model.lm.config, model.config.base_model)
            (tmp / PEFT_CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
            save_file(peft_tensors, str(tmp / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
        tensors = {
            k: v.detach().float().cpu().contiguous() for k, v in model.stream_parameters().items()
        }
        save_file(tensors, str(tmp / STREAM_FILE), metadata={"format": "pt"})
    return out


def load_adapter(
    adapter_dir: str | Path, base: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> SpecStreamModel:
    """Load an adapter checkpoint onto its base model (``base`` overrides the recorded one)."""
    adapter_dir = Path(adapter_dir)
    config = SpecStreamConfig.load(adapter_dir)
    base = resolve_base(base, config.base_model, adapter_dir / CONFIG_FILE)
    stream_file = adapter_dir / STREAM_FILE
    if not stream_file.is_file():
        raise ConfigError(f"{stream_file}: missing; the adapter has no stream tensors")
    tensors = read_tensors(stream_file)
    hf_config = base_config(base)  # checked before the weights load
    check_stream_tensors(tensors, config, hf_config.hidden_size, str(stream_file), hf_config)
    lm = load_base_lm(base, dtype)
    # A streams-only adapter's PEFT files are vLLM's null LoRA (adding zero); a two-stage
    # adapter's are the first stage's LoRA.
    if (adapter_dir / PEFT_CONFIG_FILE).is_file():
        from peft import PeftModel

        try:
            lm = PeftModel.from_pretrained(lm, str(adapter_dir))
        except RuntimeError as e:  # size mismatch: another base model
            raise ConfigError(
                f"{adapter_dir / PEFT_WEIGHTS_FILE}: does not fit the base model {base} "
                f"({str(e).strip().splitlines()[-1].strip()}); pass --base with the model the "
                "adapter was trained on"
            ) from None
    model = SpecStreamModel(lm, config)
    load_stream_tensors(model, tensors)
    return model.eval()


def load_stream_tensors(model: SpecStreamModel, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.stream_parameters().items():
            param.copy_(tensors[name].to(param.dtype))


#: What an export writes: the base's weights (one file or shards and their index), its
#: config, the stream tensors and the tokenizer's files.
_EXPORT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def _export_written(name: str) -> bool:
    return (
        name in ("config.json", STREAM_FILE)
        or name in TOKENIZER_FILES
        or _EXPORT_FILE.fullmatch(name) is not None
    )


def check_export_target(out: Path, *sources: Path) -> None:
    """Refuse an output directory whose contents an export would lose: a file, one of
    ``sources`` (the adapter, the base) or a directory holding them, or a non-empty
    directory that is not an earlier merged export holding only what an export writes."""
    where = f"{out}: "
    fix = "give a new or empty directory, e.g. " + str(sources[0].resolve()) + "-merged"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where}is a file, not a directory; {fix}")
    target = out.resolve()
    for source in sources:
        source = source.resolve()
        if target == source or target in source.parents:
            raise ConfigError(f"{where}is or holds {source}, which export reads; {fix}")
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    try:
        architectures = json.loads((out / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        architectures = None
    if architectures != [MERGED_ARCHITECTURE]:
        more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
        raise ConfigError(
            f"{where}holds {entries[0]!r}{more} and is not an earlier specstream export; "
            f"nothing was written; {fix}, or remove it yourself"
        )
    foreign = [name for name in entries if not _export_written(name)]
    if foreign:
        raise ConfigError(
            f"{where}an earlier export, but it also holds {foreign[0]!r}, which export does not "
            f"write and would lose; nothing was written; move it out, or {fix}"
        )


def export_merged(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    suffix_drafts: str | None = None,
) -> Path:
    """Write a merged checkpoint that vLLM loads with the specstream plugin. ``suffix_drafts``
    (``on``, ``off`` or a score threshold) sets its serving default of suffix drafts beside
    the streams (:attr:`SpecStreamConfig.suffix_drafts`); None keeps the adapter's.

    ``out_dir`` must be new, empty or an earlier export (:func:`check_export_target`); the
    checkpoint is written beside it and renamed into place, so a failed export leaves it as
    it was."""
    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    config = SpecStreamConfig.load(adapter_dir)
    if suffix_drafts is not None:
        value = suffix_drafts.strip().lower()
        config = dataclasses.replace(config, suffix_drafts=None if value == "off" else value)
        config.validate(where="--suffix-drafts")
    base_dir = Path(resolve_base(base, config.base_model, adapter_dir / CONFIG_FILE))
    check_export_target(out, adapter_dir, base_dir)
    model = load_adapter(adapter_dir, base=base_dir, dtype=torch.float32)
    lm = model.lm.merge_and_unload() if hasattr(model.lm, "merge_and_unload") else model.lm
    lm = lm.to(dtype)
    lm.config.dtype = dtype
    with new_dir(out) as tmp:
        lm.save_pretrained(str(tmp), safe_serialization=True)
        copy_tokenizer(tmp, base_dir)
        tensors = {
            STREAM_PREFIX + k: v.detach().to(dtype).contiguous()
            for k, v in model.stream_parameters().items()
        }
        save_file(tensors, str(tmp / STREAM_FILE), metadata={"format": "pt"})
        config_path = tmp / "config.json"
        hf_config = json.loads(config_path.read_text())
        section = dataclasses.replace(model.config, suffix_drafts=config.suffix_drafts).to_dict()
        section.pop("loss", None)
        section["base_architectures"] = hf_config.get("architectures", [])
        hf_config["architectures"] = [MERGED_ARCHITECTURE]
        hf_config["specstream"] = section
        config_path.write_text(json.dumps(hf_config, indent=2) + "\n")
        index = tmp / "model.safetensors.index.json"
        if index.is_file():  # sharded: vLLM loads only what the index lists
            data = json.loads(index.read_text())
            data["weight_map"].update({name: STREAM_FILE for name in tensors})
            index.write_text(json.dumps(data, indent=2) + "\n")
        check_export_target(out, adapter_dir, base_dir)  # as it is now, before the swap
    return out


def is_peft_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT LoRA directory (a fine-tune given as base + LoRA)."""
    p = Path(path)
    return (p / PEFT_CONFIG_FILE).is_file() and not (p / "config.json").is_file()


def merge_peft_base(peft_dir: str | Path, out_dir: str | Path) -> Path:
    """A user's fine-tune given as a PEFT LoRA: its LoRA merged into the base it names
    (``adapter_config.json: base_model_name_or_path``, a local directory) in fp32, written
    to ``out_dir`` with the tokenizer (the LoRA directory's, else the base's). Reused when
    ``out_dir`` already holds it."""
    from peft import PeftModel

    peft_dir, out = Path(peft_dir), Path(out_dir)
    if (out / "config.json").is_file():
        return out
    config_file = peft_dir / PEFT_CONFIG_FILE
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{config_file}: unreadable ({e})") from e
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(
            f"{config_file}: base_model_name_or_path is {base!r}, not a local model directory; "
            "set it to the path of the base model the LoRA was trained on"
        )
    lm = PeftModel.from_pretrained(load_base_lm(base), str(peft_dir)).merge_and_unload()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: not empty and not a merged model; give a new directory")
    with new_dir(out) as tmp:
        lm.save_pretrained(str(tmp), safe_serialization=True)
        copy_tokenizer(tmp, peft_dir, Path(base))
    return out


#: The training records a run writes beside its adapter files.
RUN_RECORDS = ("train_args.json", "train_state.json", "train_log.jsonl")


def store_tensors_in(adapter_dir: str | Path, dtype: torch.dtype) -> None:
    """Rewrite an adapter's LoRA and stream tensors in ``dtype`` (bf16: half the bytes;
    loading casts them to the model's dtype)."""
    for name in (PEFT_WEIGHTS_FILE, STREAM_FILE):
        path = Path(adapter_dir) / name
        if path.is_file():
            tensors = read_tensors(path)
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(tensors, str(path), metadata={"format": "pt"})


def two_stage_adapter(
    first: str | Path, second: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """The two stages of the two-stage objective as one adapter of the first stage's base:
    the LoRA of ``first`` (a next-token run) and the streams of ``second`` (a streams-only
    run on ``first`` merged). Exported, it is ``second`` exported onto ``first`` merged (in
    the export's dtype); the second stage's records come along, the first stage's go into
    ``OUT/first_stage/``. ``dtype`` (e.g. bf16: half the bytes) stores the tensors in it;
    None keeps the runs' float32."""
    first, second, out = Path(first), Path(second), Path(out_dir)
    streams = SpecStreamConfig.load(second)
    for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, CONFIG_FILE):
        if not (first / name).is_file():
            raise ConfigError(f"{first}: no {name}; the first stage is a next-token LoRA run")
    out.mkdir(parents=True, exist_ok=True)
    for src, name in ((first, PEFT_CONFIG_FILE), (first, PEFT_WEIGHTS_FILE), (second, STREAM_FILE)):
        shutil.copy2(src / name, out / name)
    if dtype is not None:
        store_tensors_in(out, dtype)
    dataclasses.replace(streams, base_model=SpecStreamConfig.load(first).base_model).save(out)
    (out / "first_stage").mkdir(exist_ok=True)
    for name in RUN_RECORDS:
        if (second / name).is_file():
            shutil.copy2(second / name, out / name)
        if (first / name).is_file():
            shutil.copy2(first / name, out / "first_stage" / name)
    return out


def read_merged_config(ckpt: str | Path) -> tuple[dict, SpecStreamConfig]:
    """``config.json`` of a merged checkpoint and its specstream section, checked."""
    path = Path(ckpt) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read ({e})") from e
    if "specstream" not in hf_config:
        raise ConfigError(
            f"{path}: no 'specstream' section; not a merged specstream checkpoint "
            f"(export one with `specstream export ADAPTER OUT`)"
        )
    section = dict(hf_config["specstream"])
    base_arch = section.pop("base_architectures", None)
    if not base_arch:
        raise ConfigError(f"{path}: specstream.base_architectures is missing")
    return hf_config, SpecStreamConfig.from_dict(section, where=f"{path} (specstream)")


def load_merged(ckpt: str | Path, dtype: torch.dtype = torch.float32) -> SpecStreamModel:
    """Load a merged checkpoint into a SpecStreamModel (for the reference decoder and eval)."""
    from transformers import AutoModelForCausalLM

    ckpt = Path(ckpt)
    hf_config, config = read_merged_config(ckpt)
    stream_file = ckpt / STREAM_FILE
    if not stream_file.is_file():
        raise ConfigError(f"{stream_file}: missing; the merged checkpoint has no stream tensors")
    raw = read_tensors(stream_file)
    tensors = {k[len(STREAM_PREFIX) :]: v for k, v in raw.items() if k.startswith(STREAM_PREFIX)}
    check_stream_tensors(tensors, config, hf_config["hidden_size"], str(stream_file), hf_config)
    lm = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    model = SpecStreamModel(lm, config)
    load_stream_tensors(model, tensors)
    return model.eval()
