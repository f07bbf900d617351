"""The worker's heap trim: every so many steps, and nothing where there is no malloc_trim."""

from vllm_specstream.model_executor.heap import HeapTrim, _malloc_trim


def test_the_heap_is_trimmed_every_so_many_steps():
    calls = []
    heap = HeapTrim(every=3, trim=calls.append)
    for _ in range(7):
        heap.step()
    assert calls == [0, 0] and heap.trims == 2


def test_glibc_trims_for_real_and_other_libcs_are_left_alone():
    trim = _malloc_trim()
    assert trim is not None  # glibc, as on every supported machine
    assert trim(0) in (0, 1)
    heap = HeapTrim(every=1, trim=None)
    heap._trim = None
    heap.step()
    assert heap.trims == 0
