"""The training loop on a tiny model with the real tokenizer: runs, saves, resumes exactly, evals."""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import venv_script
from safetensors.torch import load_file
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import SpecStreamConfig
from vllm_specstream.training.args import TrainArgs
from vllm_specstream.training.batches import batch_indices, seen_examples
from vllm_specstream.training.checkpoint import LoraSettings
from vllm_specstream.training.device import resolve_device, resolve_dtype
from vllm_specstream.training.train import lr_factor, train

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny_base(base_model_dir, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    d = tmp_path_factory.mktemp("tiny-base")
    tiny_llama(vocab=49152, layers=3).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base_model_dir / name, d / name)
    return d


def args_for(base, out, steps=4, **kw):
    settings = dict(
        task="sql",
        batch_size=2,
        spec=SpecStreamConfig(num_streams=2, num_msa_layers=2),
        lora=LoraSettings(rank=4, layers="msa"),
        num_train=16,
        num_eval=4,
        save_every=2,
        eval_every=4,
        warmup_steps=1,
        max_length=96,
        dtype="fp32",
    )
    return TrainArgs(base=str(base), out=str(out), steps=steps, **{**settings, **kw})


def test_batches_are_a_pure_function_of_the_step():
    assert batch_indices(10, 4, 2, 0) == batch_indices(10, 4, 2, 0)
    seen = [i for s in range(5) for i in batch_indices(10, 4, s, 0)]
    assert sorted(seen[:10]) == list(range(10))  # each epoch is a permutation
    assert lr_factor(0, 10, 100) == pytest.approx(0.1) and lr_factor(100, 10, 100) == pytest.approx(
        0.1
    )


def test_seen_examples_are_those_the_batches_drew():
    for micro_steps in (0, 3, 5, 7):
        drawn = {i for s in range(micro_steps) for i in batch_indices(10, 4, s, 3)}
        assert seen_examples(10, 4, micro_steps, 3) == drawn
    # A continued run warms up again from its first step, then follows the run's schedule.
    assert lr_factor(50, 10, 100, continued_at=50) == pytest.approx(lr_factor(50, 10, 100) / 10)
    assert lr_factor(60, 10, 100, continued_at=50) == pytest.approx(lr_factor(60, 10, 100))


def test_device_choices_and_their_errors():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp32", torch.device("cuda")) == torch.float32
    with pytest.raises(ValueError, match="--device must be cpu, cuda"):
        resolve_device("mps")
    with pytest.raises(ValueError, match="--device 'gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU; use --device cpu"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_on_a_gpu_follows_the_cpu_run(tiny_base, tmp_path):
    """The same run (fp32, packing and the frozen-prefix cache on) on the GPU and on the CPU:
    the same losses step by step and the same adapter, up to the GPU's summation order."""
    logs, streams = {}, {}
    for device in ("cpu", "cuda"):
        out = train(args_for(tiny_base, tmp_path / device, steps=4, device=device), progress=False)
        logs[device] = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        streams[device] = load_file(str(out / "specstream.safetensors"))
    for cpu, gpu in zip(logs["cpu"], logs["cuda"], strict=True):
        for k in ("loss", "loss_main", "loss_stream1", "eval_loss"):
            if k in cpu:
                assert gpu[k] == pytest.approx(cpu[k], rel=2e-3), (cpu["step"], k)
    for name, t in streams["cpu"].items():
        torch.testing.assert_close(streams["cuda"][name], t, rtol=1e-2, atol=1e-3)


def test_a_run_starts_from_a_trained_adapter(tiny_base, tmp_path):
    """--init-from with another objective than prune: the LoRA and streams of the adapter are
    the start (at lr 0 the adapter comes out unchanged, its streams not re-initialised);
    an adapter of other settings is refused by name."""
    from vllm_specstream.checkpoint.config import ConfigError

    first = train(args_for(tiny_base, tmp_path / "first", steps=2), progress=False)
    again = args_for(tiny_base, tmp_path / "again", steps=2, init_from=str(first))
    again.lr = again.stream_lr = 0.0
    train(again, progress=False)
    for name in ("specstream.safetensors", "adapter_model.safetensors"):
        before, after = (load_file(str(d / name)) for d in (first, tmp_path / "again"))
        assert before.keys() == after.keys()
        for k in before:
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    other = args_for(tiny_base, tmp_path / "other", steps=1, init_from=str(first))
    other.spec = SpecStreamConfig(num_streams=3, num_msa_layers=2)
    with pytest.raises(ConfigError, match="its num_streams is 2, this run's 3"):
        train(other, progress=False)


def _killed(monkeypatch, loss_calls: int, args) -> None:
    """Train ``args``, killed at the ``loss_calls``-th loss computation (steps and
    evaluation batches alike)."""
    import vllm_specstream.training.jobs as jobs_module

    real_loss, calls = jobs_module.specstream_loss, []

    def dying_loss(*a, **kw):
        calls.append(1)
        if len(calls) == loss_calls:
            raise KeyboardInterrupt
        return real_loss(*a, **kw)

    with monkeypatch.context() as patched:
        patched.setattr(jobs_module, "specstream_loss", dying_loss)
        with pytest.raises(KeyboardInterrupt):
            train(args, progress=False)


def test_interrupted_run_resumes_to_the_same_result(tiny_base, tmp_path, monkeypatch):
    full = train(args_for(tiny_base, tmp_path / "full"), progress=False)
    # Kill the run during step 4 (step 3 logged, last save at step 2), then run it again.
    part = tmp_path / "part"
    _killed(monkeypatch, 4, args_for(tiny_base, part))
    assert not (part / "specstream.safetensors").exists()
    state = torch.load(part / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2
    resumed = train(args_for(tiny_base, part), progress=False)
    a, b = (
        load_file(str(full / "specstream.safetensors")),
        load_file(str(resumed / "specstream.safetensors")),
    )
    torch.testing.assert_close(a["stream_embeddings"], b["stream_embeddings"], atol=1e-6, rtol=1e-6)
    la = load_file(str(full / "adapter_model.safetensors"))
    lb = load_file(str(resumed / "adapter_model.safetensors"))
    for k in la:
        torch.testing.assert_close(la[k], lb[k], atol=1e-6, rtol=1e-6)
    log = [json.loads(x) for x in (full / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    log = [json.loads(x) for x in (resumed / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]  # step 3 runs twice, is logged once
    assert {"loss_main", "loss_stream1", "top1_stream2", "eval_loss"} <= set(log[-1])


def test_a_finished_run_extends_with_more_steps_and_ignores_fewer(tiny_base, tmp_path):
    out = tmp_path / "run"
    train(args_for(tiny_base, out, steps=2), progress=False)
    train(args_for(tiny_base, out, steps=4), progress=False)  # resumes at 2, trains 3-4
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    before = load_file(str(out / "specstream.safetensors"))["stream_embeddings"]
    train(args_for(tiny_base, out, steps=2), progress=False)  # already past: nothing changes
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4
    after = load_file(str(out / "specstream.safetensors"))["stream_embeddings"]
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_a_run_stopped_by_time_continues_from_its_adapter_alone(tiny_base, tmp_path):
    """--max-minutes writes a usable adapter; --continue-from that adapter (without the
    optimizer's checkpoint, as committed) trains on where the data and schedule left off."""
    from vllm_specstream.checkpoint.config import ConfigError

    whole = train(args_for(tiny_base, tmp_path / "whole", steps=6, warmup_steps=2), progress=False)
    first = train(
        args_for(tiny_base, tmp_path / "first", steps=6, warmup_steps=2, max_minutes=1e-9),
        progress=False,
    )
    state = json.loads((first / "train_state.json").read_text())
    assert (state["step"], state["steps"], state["examples_seen"]) == (1, 6, 2)
    assert (first / "specstream.safetensors").is_file()
    committed = tmp_path / "committed"
    shutil.copytree(first, committed, ignore=shutil.ignore_patterns("checkpoint"))

    with pytest.raises(ConfigError, match=r"batch_size=2, this run has 4; continue with"):
        bad = args_for(tiny_base, tmp_path / "bad", 6, warmup_steps=2, batch_size=4)
        train(dataclasses.replace(bad, continue_from=str(committed)), progress=False)
    with pytest.raises(ConfigError, match="not the adapter of an unfinished run"):
        train(args_for(tiny_base, tmp_path / "bad2", continue_from=str(whole / "nope")))

    rest = train(
        args_for(
            tiny_base, tmp_path / "rest", steps=6, warmup_steps=2, continue_from=str(committed)
        ),
        progress=False,
    )
    log = [json.loads(x) for x in (rest / "train_log.jsonl").read_text().splitlines()]
    full = [json.loads(x) for x in (whole / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    # Step 2 starts from the same weights on the same batch as the uninterrupted run...
    assert log[1]["loss"] == pytest.approx(full[1]["loss"], rel=1e-5)
    # ...with fresh optimizer moments under a warm-up, then the run's schedule.
    assert log[1]["lr"] == pytest.approx(full[1]["lr"] / 2)
    assert log[3]["lr"] == pytest.approx(full[3]["lr"])
    state = json.loads((rest / "train_state.json").read_text())
    assert (state["step"], state["examples_seen"], state["distinct_examples"]) == (6, 12, 12)
    assert [(x["from"], x["to"]) for x in state["segments"]] == [(0, 1), (1, 6)]
    assert state["train_examples"] == 16


def test_a_continued_run_killed_before_its_progress_file_keeps_the_earlier_segments(
    tiny_base, tmp_path, monkeypatch
):
    first = train(
        args_for(tiny_base, tmp_path / "first", steps=6, warmup_steps=2, max_minutes=1e-9),
        progress=False,
    )
    committed = tmp_path / "committed"
    shutil.copytree(first, committed, ignore=shutil.ignore_patterns("checkpoint"))
    # Continue it, killed during step 5 (steps 2-4, step 4's evaluation of 2 batches, the
    # last save at step 4), then run it again as a script would: resumed from its own
    # checkpoint, no --continue-from.
    rest = tmp_path / "rest"
    chained = args_for(tiny_base, rest, steps=6, warmup_steps=2, continue_from=str(committed))
    _killed(monkeypatch, 6, chained)
    assert not (rest / "train_state.json").exists()
    train(args_for(tiny_base, rest, steps=6, warmup_steps=2), progress=False)
    state = json.loads((rest / "train_state.json").read_text())
    assert [(x["from"], x["to"]) for x in state["segments"]] == [(0, 1), (1, 4), (4, 6)]


def test_cli_train_export_eval(tiny_base, tmp_path):
    spec = venv_script("specstream")
    run = lambda *a: subprocess.run([spec, *a], capture_output=True, text=True, timeout=600)  # noqa: E731
    out = run(
        "train",
        "--base",
        str(tiny_base),
        "--out",
        str(tmp_path / "a"),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--num-train",
        "8",
        "--num-eval",
        "2",
        "--num-streams",
        "2",
        "--num-msa-layers",
        "2",
        "--lora-rank",
        "4",
        "--max-length",
        "96",
        "--dtype",
        "fp32",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train specstream" in out.stderr  # the progress bar
    out = run("export", str(tmp_path / "a"), str(tmp_path / "m"))  # merging is the default
    assert out.returncode == 0, out.stderr[-3000:]
    assert "suffix drafts" not in out.stdout  # no serving default: nothing to say
    out = run(
        "export", str(tmp_path / "a"), str(tmp_path / "s"), "--merge", "--suffix-drafts", "on"
    )
    assert out.returncode == 0 and "Serves with suffix drafts beside the streams" in out.stdout
    assert (
        json.loads((tmp_path / "s" / "config.json").read_text())["specstream"]["suffix_drafts"]
        == "on"
    )
    out = run("export", str(tmp_path / "a"), str(tmp_path / "x"), "--merge", "--suffix-drafts", "x")
    assert out.returncode == 2 and out.stderr.strip().endswith(
        "suffix_drafts must be 'on' (suffix drafts where they yield as many tokens per step "
        "cost as the streams), a score threshold >= 0, or 'off', got 'x'"
    ), out.stderr
    out = run(
        "eval",
        "--checkpoint",
        str(tmp_path / "m"),
        "--task",
        "sql",
        "-n",
        "2",
        "--max-new-tokens",
        "8",
        "--base",
        str(tiny_base),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"chain", "tree"} <= set(result["tokens_per_step"])
    assert "exact_match" in result and result["extra_params"] == 2 * 64
    assert result["chain_tree_identical"] is True


def test_medusa_objective_writes_vllm_medusa_checkpoint(tiny_base, tmp_path):
    args = args_for(tiny_base, tmp_path / "medusa", steps=2)
    args.objective, args.medusa_heads = "medusa", 3
    out = train(args, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["num_heads"] == 3
    assert config["original_lm_head"] is True and config["vocab_size"] == 49152
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == {f"blocks.{j}.layers.0.weight" for j in range(3)} | {"lm_head.weight"}
    assert tensors["blocks.0.layers.0.weight"].abs().sum() > 0  # trained away from zero init
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert {"loss_head1", "top1_head3"} <= set(log[-1])


def test_medusa_heads_continue_from_trained_heads(tiny_base, tmp_path):
    """--init-from with objective medusa: the trained heads are the start (at lr 0 they come
    out unchanged, not the zero init); heads of another count are refused by name."""
    from vllm_specstream.checkpoint.config import ConfigError

    first = tmp_path / "first"
    args = args_for(tiny_base, first, steps=2)
    args.objective, args.medusa_heads = "medusa", 2
    train(args, progress=False)
    again = args_for(tiny_base, tmp_path / "again", steps=1, init_from=str(first))
    again.objective, again.medusa_heads, again.lr = "medusa", 2, 0.0
    train(again, progress=False)
    before, after = (load_file(str(d / "model.safetensors")) for d in (first, tmp_path / "again"))
    assert before["blocks.0.layers.0.weight"].abs().sum() > 0
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    other = args_for(tiny_base, tmp_path / "other", steps=1, init_from=str(first))
    other.objective, other.medusa_heads = "medusa", 3
    with pytest.raises(ConfigError, match="num_heads 2, this run 3; pass --medusa-heads 2"):
        train(other, progress=False)


def test_zero_initialised_medusa_head_copies_the_next_token_head():
    from vllm_specstream.training.medusa import MedusaHeads, medusa_drafts

    lm = tiny_llama()
    heads = MedusaHeads(lm, 2)
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        hidden = lm.model(ids).last_hidden_state[0, -1]
        want = int(lm(ids).logits[0, -1].argmax())
    assert medusa_drafts(heads, hidden) == [want, want]


def test_streams_only_trains_on_the_models_replies(tiny_base, tmp_path):
    """Objective streams-only with a self-distillation file: each prompt's completion is the
    file's reply; no LoRA on the main stream; the stream LoRA trains and is saved."""
    from vllm_specstream.training.batches import load_examples

    args = args_for(tiny_base, tmp_path / "so", steps=2)
    args.objective = "streams-only"
    args.spec = SpecStreamConfig(num_streams=2, num_msa_layers=2, stream_lora_rank=4)
    examples = [*load_examples(args, "train", 16), *load_examples(args, "test", 4)]
    distill = tmp_path / "self_distill.jsonl"
    distill.write_text(
        "".join(
            json.dumps({"messages": e.messages, "completion": "SELECT 1"}) + "\n" for e in examples
        )
    )
    args.distill = str(distill)
    assert {e.completion for e in load_examples(args, "train", 16)} == {"SELECT 1"}
    out = train(args, progress=False)
    # vLLM multi-LoRA's view of it: a LoRA that changes nothing (the main stream is the base)
    peft = json.loads((out / "adapter_config.json").read_text())
    assert peft["r"] == 1 and peft["target_modules"] == ["o_proj"]
    null = load_file(str(out / "adapter_model.safetensors"))
    assert len(null) == 2 and all(not t.any() for t in null.values())
    tensors = load_file(str(out / "specstream.safetensors"))
    assert tensors["stream_lora_1_qkv_b"].abs().sum() > 0  # trained away from zero init
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert "loss_stream1" in log[-1] and "loss_main" not in log[-1]
    args.steps = 3  # resumes from its checkpoint, whose PEFT files are the null LoRA
    assert train(args, progress=False) == out
    assert json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_distill_option_feeds_medusa_the_streams_only_runs_replies(tiny_base, tmp_path):
    """``--distill RUN_DIR`` reads the run's self_distill.jsonl (Medusa heads on the frozen
    base learn the same replies as a streams-only adapter); a missing file names the flag."""
    from vllm_specstream.cli.train import _distill_file
    from vllm_specstream.training.batches import load_examples

    run = tmp_path / "so-run"
    run.mkdir()
    with pytest.raises(SystemExit, match=r"--distill .*so-run: no such file"):
        _distill_file(str(run), must_exist=True)
    assert _distill_file(str(run), must_exist=False) == str(run / "self_distill.jsonl")
    args = args_for(tiny_base, tmp_path / "medusa", steps=1)
    args.objective, args.medusa_heads = "medusa", 2
    examples = [*load_examples(args, "train", 16), *load_examples(args, "test", 4)]
    (run / "self_distill.jsonl").write_text(
        "".join(
            json.dumps({"messages": e.messages, "completion": "SELECT 2"}) + "\n" for e in examples
        )
    )
    args.distill = _distill_file(str(run), must_exist=True)
    assert {e.completion for e in load_examples(args, "train", 16)} == {"SELECT 2"}
    assert (train(args, progress=False) / "config.json").is_file()


def test_a_frozen_lora_keeps_the_adapter_and_trains_its_streams(tiny_base, tmp_path):
    """``lora_lr`` 0 continuing an adapter: its LoRA comes out bit-identical (what it says is
    unchanged) while the stream embeddings and the stream init adapter learn."""
    spec = SpecStreamConfig(num_streams=2, num_msa_layers=2, init_rank=4)
    start = args_for(tiny_base, tmp_path / "first", steps=2)
    start.spec = spec
    first = train(start, progress=False)
    frozen = args_for(tiny_base, tmp_path / "frozen", steps=2, init_from=str(first))
    frozen.spec, frozen.lora_lr, frozen.lr = spec, 0.0, 1e-2
    train(frozen, progress=False)
    load = lambda d, name: load_file(str(d / name))  # noqa: E731
    lora_before = load(first, "adapter_model.safetensors")
    lora_after = load(tmp_path / "frozen", "adapter_model.safetensors")
    assert lora_before.keys() == lora_after.keys() and lora_before
    for k in lora_before:
        torch.testing.assert_close(lora_after[k], lora_before[k], rtol=0, atol=0)
    streams_before = load(first, "specstream.safetensors")
    streams_after = load(tmp_path / "frozen", "specstream.safetensors")
    for name in ("stream_embeddings", "init_a", "init_b"):
        key = next(k for k in streams_before if k.endswith(name))
        assert not torch.equal(streams_after[key], streams_before[key]), key
    recorded = json.loads((tmp_path / "frozen" / "train_args.json").read_text())
    assert recorded["lora_lr"] == 0.0


def test_continuing_an_adapter_learns_its_own_replies(tiny_base, tmp_path, monkeypatch):
    """``--init-from ADAPTER --distill FILE``: the replies FILE lacks are written by the
    adapter merged into the base (vLLM's generation stubbed here), in a directory removed
    afterwards, and the run learns them; run again with every reply there, nothing is merged."""
    from vllm_specstream import cli
    from vllm_specstream.training import replies as distill

    trained = train(args_for(tiny_base, tmp_path / "ss", steps=2), progress=False)
    models = []

    def replies(model, examples, path, settings):
        models.append(model)
        assert (Path(model) / "config.json").is_file()  # a merged checkpoint vLLM can load
        path.write_text(
            "".join(
                json.dumps({"messages": e.messages, "completion": "SELECT 3"}) + "\n"
                for e in examples
            )
        )
        return path

    monkeypatch.setattr(distill, "distill_replies", replies)
    out, file = tmp_path / "sd", tmp_path / "replies.jsonl"
    argv = [
        "train", "--base", str(tiny_base), "--out", str(out), "--task", "sql",
        "--init-from", str(trained), "--distill", str(file), "--num-train", "16",
        "--num-eval", "4", "--batch-size", "2", "--num-streams", "2", "--num-msa-layers", "2",
        "--lora-rank", "4", "--lora-layers", "msa", "--steps", "1",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert len(models) == 1 and Path(models[0]).parent.parent == out
    assert not Path(models[0]).exists()
    recorded = json.loads((out / "train_args.json").read_text())
    assert recorded["distill"] == str(file) and recorded["init_from"] == str(trained)
    assert cli.main([*argv[:-1], "2"]) == 0
    assert len(models) == 1
    # Without --init-from the file must exist: nothing would say whose replies to write.
    fresh = ["train", "--base", str(tiny_base), "--out", str(tmp_path / "x"), "--task", "sql"]
    with pytest.raises(SystemExit, match="no such file"):
        cli.main([*fresh, "--distill", str(tmp_path / "none.jsonl")])


def test_prune_objective_adds_the_pruning_adapter_to_a_trained_one(tiny_base, tmp_path):
    """Objective prune: the pruning tensors train on a trained adapter; its LoRA and stream
    tensors are saved unchanged, the config turns pruning on, and the loss falls."""
    from transformers import AutoTokenizer

    from vllm_specstream.checkpoint.config import PruneConfig
    from vllm_specstream.training.batches import collate, load_examples
    from vllm_specstream.training.checkpoint import load_adapter
    from vllm_specstream.training.data import encode_example
    from vllm_specstream.training.loss import specstream_loss

    trained = train(args_for(tiny_base, tmp_path / "ss", steps=2), progress=False)
    args = args_for(tiny_base, tmp_path / "prune", steps=10)
    args.objective, args.init_from, args.lr = "prune", str(trained), 1e-2
    args.spec = SpecStreamConfig(prune=PruneConfig(rank=4, threshold=0.02))
    out = train(args, progress=False)
    config = SpecStreamConfig.load(out)
    assert config.prune.enabled and config.prune.rank == 4 and config.prune.threshold == 0.02
    assert (config.num_streams, config.num_msa_layers) == (2, 2)  # the trained adapter's
    before, after = (
        load_file(str(trained / "specstream.safetensors")),
        load_file(str(out / "specstream.safetensors")),
    )
    assert set(after) == set(before) | {"prune_a", "prune_b"}
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert after["prune_b"].abs().sum() > 0  # trained away from its zero init
    lora_before = load_file(str(trained / "adapter_model.safetensors"))
    lora_after = load_file(str(out / "adapter_model.safetensors"))
    assert lora_before.keys() == lora_after.keys()
    assert all(torch.equal(lora_before[k], lora_after[k]) for k in lora_before)
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert "loss_prune" in log[-1] and "loss_main" not in log[-1]
    # the training examples' pruning loss against the untrained adapter (prune_b = 0)
    model = load_adapter(out).eval()
    tok = AutoTokenizer.from_pretrained(tiny_base)
    batch = collate([encode_example(tok, e, 96) for e in load_examples(args, "train", 16)])
    with torch.no_grad():
        trained_loss = specstream_loss(model, batch, "prune")[0]
        model.prune_b.zero_()
        untrained_loss = specstream_loss(model, batch, "prune")[0]
    assert trained_loss < untrained_loss - 0.1
