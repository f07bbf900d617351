"""Which vLLM model class a merged checkpoint gets, and the errors for ones it cannot."""

from types import SimpleNamespace

import pytest

from vllm_specstream.checkpoint.merged import BASE_CLASSES

specstream = pytest.importorskip("vllm_specstream.model_executor.specstream")


def hf_config(**section):
    return SimpleNamespace(specstream=section, num_hidden_layers=4)


def test_each_base_family_has_a_class():
    for arch in BASE_CLASSES:
        assert specstream.base_architecture(hf_config(base_architectures=[arch])) == arch
        assert issubclass(specstream.FAMILY_CLASSES[arch], specstream.SpecStreamMixin)


@pytest.mark.parametrize("base", [["GPT2LMHeadModel"], [], None])
def test_unsupported_base_architecture_is_named(base):
    with pytest.raises(specstream.ConfigError, match="specstream.base_architectures is") as e:
        specstream.base_architecture(hf_config(base_architectures=base))
    assert "Qwen3 (qwen3)" in str(e.value) and "Phi-3 (phi3)" in str(e.value)


def test_missing_section_says_how_to_export():
    with pytest.raises(specstream.ConfigError, match="specstream export"):
        specstream.base_architecture(SimpleNamespace(num_hidden_layers=4))
