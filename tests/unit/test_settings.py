"""The plugin's per-engine configuration: the fields of ``additional_config["specstream"]``,
and the refusal of the environment variables and proposer classes they replace."""

import json
import math
from types import SimpleNamespace

import pytest

from vllm_specstream import PROPOSER, speculative_config
from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.speculation.settings import (
    FIELDS,
    KEY,
    RETIRED_VARIABLES,
    SETTINGS_KEY,
    EngineSettings,
    check_fields,
    check_proposer,
    fields_of,
    hand_down,
    resolve_settings,
)


def engine(k=4, model=PROPOSER, **fields):
    """An engine config speculating ``k`` drafts with ``model``, the plugin's ``fields``."""
    spec = SimpleNamespace(
        method="custom_class",
        model=model,
        num_speculative_tokens=k,
        num_speculative_tokens_per_batch_size=None,
    )
    return SimpleNamespace(
        speculative_config=spec,
        model_config=SimpleNamespace(max_model_len=64),
        additional_config={KEY: fields},
    )


def test_unset_fields_are_the_defaults():
    for config in (engine(), SimpleNamespace(additional_config=None), SimpleNamespace()):
        options = resolve_settings(config, {})
        assert options.placement is None and options.stream_dtype == "auto"
        assert options.draft_min_prob == 0.0 and options.tree_top_k is None
        assert options.tree_prune is None and options.suffix_drafts is None
    assert check_fields(None) == EngineSettings()
    assert fields_of(SimpleNamespace(additional_config={"other_plugin": 1})) == {}


@pytest.mark.parametrize(
    ("field", "value", "attribute", "parsed"),
    [
        ("placement", "window", "placement", "window"),
        ("placement", "accepted", "placement", "accepted"),
        ("placement", None, "placement", None),
        ("stream_dtype", "BFloat16", "stream_dtype", "bfloat16"),
        ("stream_dtype", "model", "stream_dtype", "model"),
        ("draft_min_prob", 0.25, "draft_min_prob", 0.25),
        ("draft_min_prob", 0, "draft_min_prob", 0.0),
        ("tree_top_k", 2, "tree_top_k", (2,)),
        ("tree_top_k", [3, 2, 1, 1], "tree_top_k", (3, 2, 1, 1)),
        ("tree_top_k", [1, 1, 1, 1], "tree_top_k", None),
        ("tree_top_k", 0, "tree_top_k", None),
        ("tree_prune", 0.05, "tree_prune", 0.05),
        ("tree_prune", "off", "tree_prune", 0.0),
        ("tree_prune", None, "tree_prune", None),
        ("suffix_drafts", 0.5, "suffix_drafts", 0.5),
        ("suffix_drafts", "1.5", "suffix_drafts", 1.5),
        ("suffix_drafts", "off", "suffix_drafts", None),
    ],
)
def test_each_field_is_parsed(field, value, attribute, parsed):
    assert getattr(resolve_settings(engine(**{field: value}), {}), attribute) == parsed


def test_suffix_drafts_on_follows_the_streams_yield():
    options = resolve_settings(engine(suffix_drafts="on"), {})
    assert math.isnan(options.suffix_drafts) and not options.suffix_from_checkpoint


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("placement", "middle"),
        ("stream_dtype", "fp8"),
        ("draft_min_prob", 1),
        ("draft_min_prob", -0.1),
        ("draft_min_prob", "high"),
        ("draft_min_prob", True),
        ("tree_top_k", "two"),
        ("tree_top_k", [2, 0]),
        ("tree_top_k", []),
        ("tree_top_k", 1.5),
        ("tree_prune", 1.5),
        ("tree_prune", "some"),
        ("suffix_drafts", "always"),
        ("suffix_drafts", -1),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(field, value):
    with pytest.raises(ConfigError) as refused:
        resolve_settings(engine(**{field: value}), {})
    message = str(refused.value)
    assert message.startswith(f"additional_config['specstream'][{field!r}]={value!r}: expected")
    # refused by the front-end's check of the section alone too, speculating or not
    with pytest.raises(ConfigError, match=f"{field!r}"):
        check_fields({KEY: {field: value}})


def test_an_unknown_field_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['tree_topk'\]") as refused:
        resolve_settings(engine(tree_topk=2), {})
    assert "did you mean 'tree_top_k'?" in str(refused.value)
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['zzz'\]; the fields are \["):
        check_fields({KEY: {"zzz": 1}})


def test_a_section_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError, match=r"additional_config\['specstream'\] must be a mapping"):
        resolve_settings(SimpleNamespace(additional_config={KEY: "tree_top_k=2"}), {})
    with pytest.raises(ConfigError, match="must be a mapping"):
        check_fields({KEY: [("tree_top_k", 2)]})


def test_suffix_drafts_and_trees_are_refused_together():
    with pytest.raises(ConfigError, match="leave out tree_top_k or suffix_drafts"):
        resolve_settings(engine(tree_top_k=2, suffix_drafts="on"), {})
    assert resolve_settings(engine(tree_top_k=2, suffix_drafts="off"), {}).trees


@pytest.mark.parametrize(
    ("variable", "value", "translated"),
    [
        ("SPECSTREAM_STREAM_DTYPE", "bfloat16", '{"stream_dtype": "bfloat16"}'),
        ("SPECSTREAM_DRAFT_MIN_PROB", "0.3", '{"draft_min_prob": 0.3}'),
        ("SPECSTREAM_TREE_TOP_K", "3,2,1,1", '{"tree_top_k": [3, 2, 1, 1]}'),
        ("SPECSTREAM_TREE_TOP_K", "2", '{"tree_top_k": 2}'),
        ("SPECSTREAM_TREE_PRUNE", "off", '{"tree_prune": "off"}'),
        ("SPECSTREAM_SUFFIX_DRAFTS", "on", '{"suffix_drafts": "on"}'),
    ],
)
def test_a_retired_variable_is_refused_naming_its_field(variable, value, translated):
    field = RETIRED_VARIABLES[variable]
    config = engine()
    with pytest.raises(ConfigError) as refused:
        resolve_settings(config, {variable: value})
    message = str(refused.value)
    assert message.startswith(f"{variable} is no longer read: set field {field!r}")
    assert f'additional_config={{"specstream": {translated}}}' in message
    assert f"--additional-config '{{\"specstream\": {translated}}}'" in message
    assert message.endswith(f"unset {variable}")
    # whether or not the engine config was read before, and without speculation too
    resolve_settings(config, {})
    with pytest.raises(ConfigError, match=f"{variable} is no longer read"):
        resolve_settings(config, {variable: value})
    with pytest.raises(ConfigError, match=f"{variable} is no longer read"):
        resolve_settings(None, {variable: value})


def test_retired_variables_are_read_from_the_process_by_default(monkeypatch):
    for variable in RETIRED_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    config = engine(tree_top_k=2)
    assert resolve_settings(config).trees
    monkeypatch.setenv("SPECSTREAM_TREE_TOP_K", "2")
    with pytest.raises(ConfigError, match="SPECSTREAM_TREE_TOP_K is no longer read"):
        resolve_settings(config)


def test_a_retired_proposer_class_is_refused_naming_its_placement():
    retired = "vllm_specstream.proposer.WindowSpecStreamProposer"
    with pytest.raises(ConfigError) as refused:
        resolve_settings(engine(model=retired), {})
    message = str(refused.value)
    assert f"model={retired!r} was moved: use {PROPOSER!r}" in message
    assert "placement='window'" in message and '{"specstream": {"placement": "window"}}' in message
    with pytest.raises(ConfigError, match="placement='accepted'"):
        check_proposer("vllm_specstream.proposer.AcceptedSpecStreamProposer")
    check_proposer(PROPOSER)
    check_proposer(None)
    check_proposer("my.Proposer")


def test_speculative_config_leaves_the_plugins_fields_to_additional_config():
    assert speculative_config(4)["model"] == PROPOSER
    assert speculative_config(4)["num_speculative_tokens"] == 4
    with pytest.raises(ValueError) as refused:
        speculative_config(4, tree_top_k=2)
    message = str(refused.value)
    assert "tree_top_k is a field of the plugin" in message
    assert "additional_config={'specstream': {'tree_top_k': 2}}" in message
    with pytest.raises(ValueError, match="placement, stream_dtype are fields.*additional_config"):
        speculative_config(4, placement="window", stream_dtype="model")


@pytest.mark.parametrize("bad", [0, -1, "x", "4", 2.0, True, None])
def test_speculative_config_refuses_a_draft_length_that_is_not_a_positive_integer(bad):
    with pytest.raises(
        ValueError, match=rf"num_speculative_tokens={bad!r}\): must be an integer >= 1"
    ):
        speculative_config(bad)


def test_a_bad_checkpoint_default_names_the_checkpoints_config():
    config = engine()
    config.model_config = SimpleNamespace(
        model="/ckpt", hf_config=SimpleNamespace(specstream={"suffix_drafts": "always"})
    )
    with pytest.raises(ConfigError, match=r"/ckpt config.json \(specstream\): suffix_drafts"):
        resolve_settings(config, {})
    # The engine's own field wins and is the one read.
    config.additional_config = {KEY: {"suffix_drafts": "off"}}
    assert resolve_settings(config, {}).suffix_drafts is None


def test_the_proposers_earlier_path_is_refused_naming_the_alias():
    with pytest.raises(ConfigError, match="was moved: use .*model_executor.proposer.*'specstream'"):
        check_proposer("vllm_specstream.proposer.SpecStreamProposer")


def test_user_schedule_is_read_by_vllms_validator():
    from vllm_specstream.patches.vllm_schedule import schedule_lookup

    lookup = schedule_lookup([(1, 2, 4), (5, 8, 2), (9, 9, 1)], 12, 3)
    # 3, 4 carry (1, 2)'s length (capped at k = 3); past the last range its length holds.
    assert lookup[1:] == [3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]
    for bad, words in [([(2, 4, 1)], "start at 1"), ([(1, 4, 1), (3, 8, 1)], "non-overlapping")]:
        with pytest.raises(ValueError, match=f"num_speculative_tokens_per_batch_size=.*{words}"):
            schedule_lookup(bad, 8, 4)


def test_speculative_config_adaptive_switch():
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(3)
    fixed = speculative_config(3, adaptive=False)["num_speculative_tokens_per_batch_size"]
    assert fixed == [(1, 1 << 16, 3)]
    mine = [(1, 1, 2), (2, 64, 0)]
    cfg = speculative_config(3, adaptive=False, num_speculative_tokens_per_batch_size=mine)
    assert cfg["num_speculative_tokens_per_batch_size"] == mine


def _vllm_config(k=4, schedule=None, model=PROPOSER, method="custom_class", **fields):
    """An engine config whose ``additional_config["specstream"]`` holds ``fields``."""
    spec = SimpleNamespace(
        num_speculative_tokens=k,
        num_speculative_tokens_per_batch_size=schedule,
        model=model,
        method=method,
    )
    return SimpleNamespace(
        speculative_config=spec,
        scheduler_config=SimpleNamespace(max_num_seqs=64),
        model_config=SimpleNamespace(max_model_len=64),
        additional_config={"specstream": fields},
    )


def test_options_are_read_once_and_name_the_bad_field():
    config = _vllm_config(3, [(1, 4, 2)], stream_dtype="BFloat16", draft_min_prob=0.25)
    options = resolve_settings(config, {})
    assert options.stream_dtype == "bfloat16" and options.draft_min_prob == 0.25
    assert options.schedule == ((1, 4, 2),) and options.num_speculative_tokens == 3
    assert resolve_settings(None, {}).draft_min_prob == 0.0  # speculation off: rule off
    assert resolve_settings(_vllm_config(3), {}).draft_min_prob == 0.0  # unset: rule off
    for name, bad in [("stream_dtype", "fp8"), ("draft_min_prob", 1), ("draft_min_prob", "high")]:
        with pytest.raises(ConfigError, match=rf"\['specstream'\]\['{name}'\]={bad!r}"):
            resolve_settings(_vllm_config(**{name: bad}), {})


def test_the_front_end_hands_its_settings_down_to_the_engine():
    """Resolved once where vLLM builds the config; the model and the proposer take that
    record from the engine config, whatever the worker's environment says."""
    config = _vllm_config(3, [(1, 4, 2)], draft_min_prob=0.25, tree_top_k=[2, 1])
    users = config.additional_config
    settings = resolve_settings(config, {})
    hand_down(config, settings)
    assert EngineSettings.of(config) == settings
    assert settings.tree_top_k == (2, 1) and settings.schedule == ((1, 4, 2),)
    assert SETTINGS_KEY not in users  # the user's dict may serve other engines
    json.dumps(config.additional_config)  # vLLM hashes it
    config.additional_config[KEY] = {"draft_min_prob": 0.5}  # read once: the record stands
    assert EngineSettings.of(config).draft_min_prob == 0.25
    # Without a front-end (an engine config built by hand), the engine resolves it itself.
    assert EngineSettings.of(_vllm_config(3, draft_min_prob=0.5)).draft_min_prob == 0.5
    stale = dict(config.additional_config, **{SETTINGS_KEY: {"placement": None}})
    with pytest.raises(ConfigError, match="not written by this vllm-specstream"):
        EngineSettings.of(SimpleNamespace(additional_config=stale))


def test_each_field_is_defined_once_and_documented():
    """The fields users set are the settings' fields made with ``user_field``; the
    configuration docs list each of them."""
    from pathlib import Path

    assert list(FIELDS) == [
        "placement",
        "stream_dtype",
        "tree_top_k",
        "tree_prune",
        "suffix_drafts",
        "draft_min_prob",
        "prompt_lookup",
    ]
    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name in FIELDS:
        assert f"| `{name}` |" in docs, name
    assert check_fields(None) == resolve_settings(None, {})


def test_other_speculative_methods_leave_the_streams_off():
    # vLLM's own methods (and other proposer classes) on a specstream checkpoint: the model
    # runs as in plain decoding, no stream pass, no error.
    for method, model in [
        ("ngram", None),
        ("suffix", None),
        ("medusa", "/heads"),
        ("custom_class", "my.Proposer"),
    ]:
        options = resolve_settings(_vllm_config(4, [(1, 4, 2)], model, method), {})
        assert options.num_speculative_tokens == 0 and options.schedule is None, method
        assert options.placement is None
    assert resolve_settings(_vllm_config(4), {}).num_speculative_tokens == 4


def test_placement_is_the_engine_field():
    assert resolve_settings(_vllm_config(4), {}).placement is None  # the model's default
    for placement in ("window", "accepted"):
        assert resolve_settings(_vllm_config(4, placement=placement), {}).placement == placement
    with pytest.raises(ConfigError, match=r"\['placement'\]='middle'"):
        resolve_settings(_vllm_config(4, placement="middle"), {})
