"""Self-distillation data for streams-only adapters: the base model's own greedy replies.

A streams-only adapter (``specstream train --objective streams-only``) keeps the base model
for every main token, so its drafts are accepted when they match what the *base* model says,
not what the task data says. The streams therefore learn from the base model's greedy
replies to the task's prompts, generated here with vLLM (greedy, fp32 by default, the
prompts tokenised exactly as training tokenises them) and cached as JSONL (``messages``,
``completion``) beside the run: a second call generates only the prompts not yet there.
Where vLLM is not installed (a GPU machine that trains), Transformers writes the same
greedy replies, on the GPU when there is one.
A run that continues a task adapter (``--init-from ADAPTER --distill FILE``) learns that
adapter's replies the same way (the adapter merged into the base writes them): its streams
learn to draft what it says rather than the references, and a small learning rate keeps its
main rows close to what they said (DialogSum: 1.70 -> 1.83 tokens per step on held-out
dialogues, ROUGE within a point of the next-token baseline).
Training reads the file without importing vLLM (:func:`~vllm_specstream.training.data.read_replies`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_specstream.logger import init_logger

logger = init_logger(__name__)

#: The cache file in a streams-only run's output directory.
DISTILL_FILE = "self_distill.jsonl"


@dataclass(frozen=True)
class DistillSettings:
    """How the base model's replies are generated."""

    max_tokens: int = 256
    """Reply length cap (tokens); a reply also ends at the model's end-of-sequence token."""
    dtype: str = "float32"
    """The engine's dtype: that of the deployment the streams will draft for."""
    batch_size: int = 128
    """Prompts given to vLLM's engine at once; their replies are appended to the file when
    all of them are done (more per call: fewer steps where only the longest replies run)."""
    context: int = 2048
    """Tokens of prompt and reply together; a longer prompt keeps its last tokens, as
    training keeps them."""
    batch_tokens: int = 262_144
    """Without vLLM: prompt tokens padded to the longest of a batch, at most this many per
    batch (at most 512 prompts): the prefill's memory on a GPU."""


def missing_prompts(examples, done: set[str]) -> list:
    """The distinct prompts of ``examples`` (ChatExamples) without a reply in ``done``."""
    from vllm_specstream.training.data import prompt_key

    out, seen = [], set(done)
    for e in examples:
        key = prompt_key(e.messages)
        if key not in seen:
            seen.add(key)
            out.append(e.messages)
    return out


def prompts_without_reply(examples, path: Path) -> list:
    """The distinct prompts of ``examples`` that the file ``path`` (if any) has no reply to."""
    from vllm_specstream.training.data import read_replies

    return missing_prompts(examples, set(read_replies(path)) if path.is_file() else set())


def distill_replies(base: str, examples, path: Path, settings: DistillSettings) -> Path:
    """Make ``path`` hold the base model's greedy reply to every prompt of ``examples``,
    generating only those it lacks (appended as they finish, so an interrupted run keeps
    what it made)."""
    from transformers import AutoTokenizer

    from vllm_specstream.training.data import prompt_ids

    todo = prompts_without_reply(examples, path)
    if not todo:
        logger.info("Self-distillation: %s has a reply for each of the prompts", path)
        return path
    if settings.max_tokens >= settings.context:
        from vllm_specstream.checkpoint.config import ConfigError

        raise ConfigError(
            f"--distill-max-tokens {settings.max_tokens} leaves no room for a prompt in the "
            f"replies' context of {settings.context} tokens: ask for fewer reply "
            f"tokens ({DistillSettings.max_tokens} by default)"
        )
    try:
        import vllm  # noqa: F401
    except ImportError:
        write = _write_with_transformers
        engine = "Transformers (vLLM is not installed)"
    else:
        write = _write_with_vllm
        engine = "vLLM"
    tokenizer = AutoTokenizer.from_pretrained(base)
    logger.info(
        "Self-distillation: generating the base model's replies to %d prompts with %s (%s, "
        "greedy, max %d tokens) into %s",
        len(todo),
        engine,
        settings.dtype,
        settings.max_tokens,
        path,
    )
    started = time.monotonic()
    # A prompt longer than the context keeps its last tokens, as training keeps them: room is
    # left for a reply of max_tokens (a Spider schema may be that long).
    room = settings.context - settings.max_tokens
    ids = [prompt_ids(tokenizer, m) for m in todo]
    cut = sum(len(x) > room for x in ids)
    ids = [x[-room:] for x in ids]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for indices, replies in write(base, ids, settings):
            for i, reply in zip(indices, replies):
                text = tokenizer.decode(reply, skip_special_tokens=True)
                f.write(json.dumps({"messages": todo[i], "completion": text}) + "\n")
            f.flush()
    logger.info(
        "Self-distillation: %d replies written in %.1f min (%d prompts longer than the "
        "model's context less %d reply tokens kept their last tokens)",
        len(todo),
        (time.monotonic() - started) / 60,
        cut,
        settings.max_tokens,
    )
    return path


def _write_with_vllm(base: str, ids: list[list[int]], settings: DistillSettings):
    """(indices, reply token ids) per batch of ``settings.batch_size`` prompts, from vLLM."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specstream.patches.cpu_env import (
        ENV_OMP_BIND,
        cpu_engine_kwargs,
        physical_cores,
        speculation_binding,
    )

    kwargs = {**cpu_engine_kwargs(dtype=settings.dtype, seed=0), "max_model_len": settings.context}
    # vLLM's auto binding keeps one of two cores for its scheduler; writing replies is a batch
    # job of compute-bound prefills, so its worker gets both unless the user chose a binding.
    binding = speculation_binding(os.environ, physical_cores(), 1)
    if binding:
        os.environ[ENV_OMP_BIND] = binding
    try:
        llm = LLM(model=base, **kwargs)
    finally:
        if binding:
            del os.environ[ENV_OMP_BIND]
    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
    for start in range(0, len(ids), settings.batch_size):
        chunk = range(start, min(start + settings.batch_size, len(ids)))
        prompts = [TokensPrompt(prompt_token_ids=ids[i]) for i in chunk]
        outputs = llm.generate(prompts, params, use_tqdm=True)
        yield chunk, [out.outputs[0].token_ids for out in outputs]
    del llm


def _write_with_transformers(base: str, ids: list[list[int]], settings: DistillSettings):
    """(indices, reply token ids) per batch from Transformers' greedy ``generate``: prompts of
    similar length batched together, left-padded, on a CUDA GPU when PyTorch sees one."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, settings.dtype))
    model.to(device).eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        from vllm_specstream.checkpoint.config import ConfigError

        raise ConfigError(
            f"{base}: no eos_token_id in its generation config, so a reply would never end: "
            "set it in generation_config.json (the token that ends the assistant's turn)"
        )
    stop = set(eos if isinstance(eos, list) else [eos])
    pad = next(iter(stop))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches, chunk = [], []
    for i in order:  # ascending length: the newest prompt is the longest of its batch
        if chunk and (len(chunk) >= 512 or (len(chunk) + 1) * len(ids[i]) > settings.batch_tokens):
            batches.append(chunk)
            chunk = []
        chunk.append(i)
    batches.append(chunk)
    bar = tqdm(total=len(ids), desc="replies", unit="prompt")
    # fp32 means fp32 on a GPU too: TF32 matmuls would change greedy choices. Switched off for
    # the replies only; the training that follows in this process keeps its own setting.
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for chunk in batches:
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk])
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=settings.max_tokens,
                    do_sample=False,
                    eos_token_id=sorted(stop),
                    pad_token_id=pad,
                )
            replies = []
            for row in out[:, width:].tolist():
                end = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
                replies.append(row[:end])
            bar.update(len(chunk))
            yield chunk, replies
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        bar.close()
