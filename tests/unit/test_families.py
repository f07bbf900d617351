"""Which bases the streams run through, and the refusals a user meets for the others."""

import pytest

from vllm_specstream.checkpoint.config import ConfigError
from vllm_specstream.checkpoint.families import BASE_CLASSES, family_of


@pytest.mark.parametrize(
    ("model_type", "name"),
    [
        ("llama", "Llama"),
        ("mistral", "Mistral"),
        ("qwen2", "Qwen2"),
        ("qwen3", "Qwen3"),
        ("phi3", "Phi-3"),
    ],
)
def test_each_supported_model_type_has_its_family(model_type, name):
    family = family_of({"model_type": model_type})
    assert family.name == name and set(family.architectures) <= set(BASE_CLASSES)


def test_an_unsupported_family_is_refused_naming_the_supported_ones():
    with pytest.raises(ConfigError) as e:
        family_of({"model_type": "gemma3_text"}, where="base/config.json")
    message = str(e.value)
    assert message.startswith("base/config.json: model_type 'gemma3_text' is not supported")
    assert "Qwen3 (qwen3)" in message and "Phi-3 (phi3)" in message


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "phi3", "rope_scaling": {"type": "longrope"}}, "'longrope'"),
        ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}}, "'longrope'"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        (
            {"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]},
            "layer_types",
        ),
    ],
)
def test_settings_the_streams_do_not_compute_are_refused_by_name(config, named):
    with pytest.raises(ConfigError, match=named):
        family_of(config)


def test_partial_rotary_and_full_attention_layers_are_accepted():
    assert family_of({"model_type": "phi3", "partial_rotary_factor": 0.75}).name == "Phi-3"
    layer_types = ["full_attention"] * 4
    assert family_of({"model_type": "qwen3", "layer_types": layer_types}).name == "Qwen3"
