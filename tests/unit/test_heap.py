"""The worker's heap trim: once so many seconds of steps have passed, and nothing where
there is no malloc_trim."""

from vllm_specstream.model_executor.heap import HeapTrim, _malloc_trim, resident_mib


def test_the_heap_is_trimmed_once_the_period_has_passed():
    calls, now = [], [0.0]
    heap = HeapTrim(every_s=2.0, trim=calls.append, clock=lambda: now[0])
    for t in (0.5, 1.9, 2.1, 2.5, 4.0, 4.2):
        now[0] = t
        heap.step()
    assert calls == [0, 0] and heap.trims == 2  # at 2.1 and 4.2


def test_glibc_trims_for_real_and_other_libcs_are_left_alone():
    trim = _malloc_trim()
    assert trim is not None  # glibc, as on every supported machine
    assert trim(0) in (0, 1)
    assert resident_mib() > 0
    heap = HeapTrim(every_s=0.0, trim=None)
    heap._trim = None
    heap.step()
    assert heap.trims == 0
