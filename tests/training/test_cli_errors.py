"""Bad inputs to the `specstream` command: each ends in one line on stderr that names the
file, field or flag and the fix, exit code 2, no traceback, nothing written or deleted."""

import json
import shutil

import pytest
import torch
from tiny import tiny_llama

from vllm_specstream.checkpoint.config import PruneConfig, SpecStreamConfig
from vllm_specstream.cli import main
from vllm_specstream.training.checkpoint import LoraSettings, build_model, save_adapter


@pytest.fixture(scope="module")
def files(base_model_dir, tmp_path_factory):
    """A tiny base with SmolLM2's tokenizer, an adapter trained (at random) on it, a base of
    another hidden size, and data files of every kind of damage."""
    root = tmp_path_factory.mktemp("bad")
    base = root / "base"
    tiny_llama(vocab=49152, layers=3).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(base_model_dir / name, base / name)
    tiny_llama(vocab=49152, layers=3, hidden_size=96, head_dim=24).save_pretrained(root / "wide")
    config = SpecStreamConfig(num_streams=2, num_msa_layers=2, prune=PruneConfig(enabled=True))
    torch.manual_seed(0)
    save_adapter(build_model(base, config, LoraSettings(rank=4)), root / "adapter")
    (root / "empty.csv").write_text("")
    (root / "binary.csv").write_bytes(bytes(range(256)) * 4)
    (root / "columns.csv").write_text('mr,text\n"name[x]",hello\n')
    (root / "object.json").write_text('{"schema": "t", "question": "q", "answer": "a"}')
    (root / "list.json").write_text('[{"context": "t", "question": "q", "answer": "a"}, 3]')
    (root / "a-file").write_text("mine")
    (root / "not-an-adapter").mkdir()
    return root


def damaged_adapter(root, name, damage):
    adapter = root / name
    if not adapter.exists():
        shutil.copytree(root / "adapter", adapter)
        damage(adapter)
    return adapter


def truncate(adapter):
    data = (adapter / "specstream.safetensors").read_bytes()
    (adapter / "specstream.safetensors").write_bytes(data[: len(data) // 2])


def scramble(adapter):
    (adapter / "specstream.safetensors").write_bytes(b"\x17" * 4096)


def edit_config(change):
    def damage(adapter):
        path = adapter / "specstream_config.json"
        path.write_text(change(path.read_text()))

    return damage


def set_field(key, value, section=None):
    def change(text):
        data = json.loads(text)
        (data[section] if section else data)[key] = value
        return json.dumps(data)

    return edit_config(change)


TRAIN = ["train", "--steps", "1", "--num-streams", "2", "--num-msa-layers", "2"]

#: (name, arguments with {root} for the files' folder, what the line must say)
CASES = [
    (
        "missing data",
        [*TRAIN, "--task", "e2e", "--data", "{root}/none.csv"],
        "{root}/none.csv: no such file",
    ),
    (
        "empty data",
        [*TRAIN, "--task", "e2e", "--data", "{root}/empty.csv"],
        "{root}/empty.csv: no records",
    ),
    (
        "binary data",
        [*TRAIN, "--task", "e2e", "--data", "{root}/binary.csv"],
        "{root}/binary.csv: not UTF-8 text",
    ),
    (
        "wrong columns",
        [*TRAIN, "--task", "e2e", "--data", "{root}/columns.csv"],
        "{root}/columns.csv:2: missing field 'ref' (fields: mr, text)",
    ),
    (
        "a JSON object, not records",
        [*TRAIN, "--task", "sql", "--data", "{root}/object.json"],
        "{root}/object.json:1: missing field 'context' (fields: schema, question, answer)",
    ),
    (
        "a record that is no object",
        [*TRAIN, "--task", "sql", "--data", "{root}/list.json"],
        "{root}/list.json:1: expected a JSON object, got int",
    ),
    (
        "missing base",
        [*TRAIN, "--base", "{root}/nowhere"],
        "--base {root}/nowhere: no such directory",
    ),
    (
        "base without config",
        [*TRAIN, "--base", "{root}/not-an-adapter"],
        "--base {root}/not-an-adapter: not a model directory",
    ),
    (
        "truncated safetensors",
        ["export", "{root}/truncated", "{root}/out"],
        "{root}/truncated/specstream.safetensors: not a readable safetensors file",
    ),
    (
        "corrupt safetensors",
        ["export", "{root}/scrambled", "{root}/out"],
        "{root}/scrambled/specstream.safetensors: not a readable safetensors file",
    ),
    (
        "config not JSON",
        ["export", "{root}/not-json", "{root}/out"],
        "{root}/not-json/specstream_config.json: not valid JSON",
    ),
    (
        "config not an object",
        ["export", "{root}/json-list", "{root}/out"],
        "{root}/json-list/specstream_config.json: expected a JSON object, got list",
    ),
    (
        "mistyped field",
        ["export", "{root}/typed", "{root}/out"],
        "{root}/typed/specstream_config.json: num_streams must be an integer, got '2'",
    ),
    (
        "mistyped nested field",
        ["export", "{root}/nested", "{root}/out"],
        "{root}/nested/specstream_config.json: prune.rank must be an integer, got 'x'",
    ),
    (
        "unknown field",
        ["export", "{root}/unknown", "{root}/out"],
        "{root}/unknown/specstream_config.json: unknown field(s) ['num_stream']",
    ),
    (
        "not an adapter",
        ["export", "{root}/not-an-adapter", "{root}/out"],
        "{root}/not-an-adapter/specstream_config.json: missing; not a specstream adapter",
    ),
    (
        "base of another size",
        ["export", "{root}/adapter", "{root}/out", "--base", "{root}/wide"],
        "(the model's hidden size is 96)",
    ),
    (
        "export into a file",
        ["export", "{root}/adapter", "{root}/a-file"],
        "{root}/a-file: is a file, not a directory",
    ),
    (
        "export into the adapter",
        ["export", "{root}/adapter", "{root}/adapter"],
        "{root}/adapter: is or holds",
    ),
    (
        "bad serving default",
        ["export", "{root}/adapter", "{root}/out", "--suffix-drafts", "x"],
        "suffix_drafts must be 'on'",
    ),
]

DAMAGES = {
    "truncated": truncate,
    "scrambled": scramble,
    "not-json": edit_config(lambda text: text[:-3]),
    "json-list": edit_config(lambda text: "[]"),
    "typed": set_field("num_streams", "2"),
    "nested": set_field("rank", "x", section="prune"),
    "unknown": set_field("num_stream", 3),
}


def snapshot(root):
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("name, argv, says", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_ends_in_one_line(files, capsys, name, argv, says):
    for folder, damage in DAMAGES.items():
        damaged_adapter(files, folder, damage)
    before = snapshot(files)
    argv = [a.format(root=files) for a in argv]
    if argv[0] == "train" and "--out" not in argv:
        argv += ["--out", str(files / "run")]
    if argv[0] == "train" and "--base" not in argv:
        argv += ["--base", str(files / "base")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specstream {argv[0]}: error: "), err
    assert says.format(root=files) in err[0]
    assert snapshot(files) == before  # nothing written, nothing deleted


def test_debug_shows_the_traceback(files):
    from vllm_specstream.checkpoint.config import ConfigError

    with pytest.raises(ConfigError, match="no such directory"):
        main(["--debug", *TRAIN, "--base", str(files / "nowhere"), "--out", str(files / "r")])
