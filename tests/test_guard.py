"""The transfer guard itself (hpcpar.guard): refusals, counted copies, the CuPy subset, stream order."""
import numpy as np
import pytest

from hpcpar import backend, guard
from hpcpar.guard import xp


@pytest.fixture(autouse=True)
def fresh_stats():
    guard.stats.reset()
    yield


def device(values):
    return xp.asarray(np.asarray(values, dtype=np.float64))


@pytest.mark.parametrize("convert", [np.asarray, np.array, float, int, bool, lambda a: a.item(), lambda a: a.tolist(),
                                     lambda a: f"{a:.3f}", lambda a: np.sum(a), lambda a: np.exp(a),
                                     lambda a: range(10)[a]])
def test_implicit_conversions_to_host_are_refused_and_counted(convert):
    a = device(3.0)
    with pytest.raises(TypeError, match="implicit device-to-host|NumPy"):
        convert(a)
    assert guard.stats.implicit == 1 and guard.stats.to_host == 0


def test_host_arrays_in_device_operations_are_refused():
    a = device([1.0, 2.0])
    with pytest.raises(TypeError, match="NumPy array passed to a device operation"):
        xp.add(a, np.ones(2))
    with pytest.raises(TypeError):
        a + np.ones(2)
    assert guard.stats.implicit >= 1


def test_explicit_copies_are_counted_with_bytes_and_call_sites():
    a = device(np.arange(4.0))              # host -> device: 32 bytes
    b = (a * 2).astype(np.float32)
    host = backend.to_host(b)               # device -> host: 16 bytes
    b.set(np.zeros(4, np.float32))          # host -> device: 16 bytes
    assert np.array_equal(host, [0, 2, 4, 6]) and isinstance(host, np.ndarray)
    assert guard.stats.snapshot() == {"to_device": 2, "to_host": 1, "bytes_to_device": 48, "bytes_to_host": 16,
                                      "syncs": 0, "implicit": 0}
    assert [site.rsplit("/", 1)[-1].split(":")[0] for _, _, site in guard.stats.log] == ["test_guard.py"] * 3


def test_device_results_stay_on_the_device():
    a = device([[1.0, 2.0], [3.0, 4.0]])
    for result in (a.sum(), a.max(), a[0, 1], xp.count_nonzero(a), a @ a, xp.exp(a).mean(axis=0), a.T, a > 2):
        assert isinstance(result, xp.ndarray)
    assert backend.get_array_module(a) is xp and backend.is_gpu_array(a)
    assert float(backend.to_host(a.sum())) == 10.0


def test_views_share_the_last_write():
    a = device(np.zeros((2, 3)))
    row = a[1]
    row[...] = 7.0
    assert backend.to_host(a).tolist() == [[0, 0, 0], [7, 7, 7]]
    assert row._written is a._written


def test_writes_through_out_and_views_are_the_last_write_of_the_whole_array():
    a, side = device(np.zeros(4)), guard.Stream()
    side.wait_event(guard.get_current_stream().record())
    with side:
        xp.add(a[:2], 1.0, out=a[:2])  # a kernel on another stream writes into a view of a
    with pytest.raises(guard.StreamOrderError):
        guard.check_ready(a)
    guard.get_current_stream().wait_event(side.record())
    assert backend.to_host(a).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_functions_cupy_lacks_fail():
    a = device([1.0, 2.0, 3.0])
    with pytest.raises(AttributeError, match="not portable CuPy"):
        xp.add.reduceat(a, xp.asarray(np.array([0, 2])))
    with pytest.raises(AttributeError, match="not portable CuPy"):
        xp.add.at(a, xp.asarray(np.array([0, 0])), 1.0)
    assert not hasattr(xp, "unique_all") and not hasattr(xp, "bfloat16")


def test_scatter_add_sums_repeats_on_every_backend():
    for module in (np, xp):
        target = module.zeros(3)
        indices = np.array([0, 2, 0]) if module is np else xp.asarray(np.array([0, 2, 0]))
        values = np.array([1.0, 2.0, 3.0]) if module is np else device([1.0, 2.0, 3.0])
        backend.scatter_add(target, indices, values)
        assert backend.to_host(target).tolist() == [4.0, 0.0, 2.0]


def test_dtypes_cupy_lacks_are_refused():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(TypeError, match="CuPy has no dtype"):
        xp.asarray(np.zeros(2, dtype=ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="CuPy has no dtype"):
        device([1.0]).astype(ml_dtypes.bfloat16)


def test_a_stream_reading_another_streams_write_must_wait_for_its_event():
    a = device([1.0, 2.0])
    side = guard.Stream(non_blocking=True)
    with pytest.raises(guard.StreamOrderError):
        with side:
            a + 1  # the null stream wrote a; side never waited
    side.wait_event(guard.get_current_stream().record())
    with side:
        assert guard.get_current_stream() is side
        b = a + 1
    assert guard.get_current_stream() is guard.Stream.null
    with pytest.raises(guard.StreamOrderError):
        guard.check_ready(b)
    early = guard.Event()
    early.record(side)
    with side:
        b += 1  # written again after the event
    guard.get_current_stream().wait_event(early)
    with pytest.raises(guard.StreamOrderError):
        guard.check_ready(b)  # the event was recorded before the last write
    late = side.record()
    guard.get_current_stream().wait_event(late)
    guard.check_ready(b)
    assert backend.to_host(b).tolist() == [3.0, 4.0]


def test_waits_are_transitive_and_host_syncs_order_everything_after():
    a, first, second = device([1.0]), guard.Stream(), guard.Stream()
    first.wait_event(guard.Stream.null.record())
    with first:
        b = a * 2
    second.wait_event(first.record())
    with second:
        c = b + 1
    guard.Stream.null.wait_event(second.record())
    guard.check_ready(b)  # null waited on second, which waited on first
    guard.check_ready(c)
    with first:
        d = b * 3
    with pytest.raises(guard.StreamOrderError):
        guard.check_synchronized(d)  # MPI (or the host) reading outside stream order
    first.synchronize()
    guard.check_synchronized(d)
    guard.check_ready(d)
    with first:
        d += 1
    event = first.record()
    event.synchronize()
    guard.check_ready(d, second)
    assert guard.stats.syncs == 2


def test_cuda_array_interface_needs_a_synchronized_producer():
    a = device([1.0, 2.0])
    with pytest.raises(guard.StreamOrderError):
        a.__cuda_array_interface__
    backend.synchronize(a)
    interface = a.__cuda_array_interface__
    assert interface["shape"] == (2,) and interface["typestr"] == "<f8"


def test_guard_is_a_device_like_the_others(monkeypatch):
    assert backend.resolve_device("guard") == "guard" and backend.array_module("guard") is xp
    monkeypatch.setenv("HPCPAR_DEVICE", "guard")
    assert backend.resolve_device("auto") == "guard" and backend.resolve_device("cpu") == "cpu"
    monkeypatch.setenv("HPCPAR_DEVICE", "tpu")
    with pytest.raises(ValueError, match="device must be one of"):
        backend.resolve_device("auto")


def test_the_gpu_memory_peak_follows_the_pool_not_its_current_size(monkeypatch):
    """peak_memory_mb reported CuPy's pool size then; now a memory hook counts the peak in use."""
    import sys
    import types

    from hpcpar.train.report import DevicePeak, peak_memory_mb

    class MemoryHook:  # what cupy.cuda.MemoryHook does with hooks: call them on malloc and free
        def __enter__(self):
            hooks.append(self)

        def __exit__(self, *exc):
            hooks.remove(self)

    hooks = []
    pool = types.SimpleNamespace(used_bytes=lambda: 100, total_bytes=lambda: 10**9)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(MemoryHook=MemoryHook),
                                 get_default_memory_pool=lambda: pool)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with DevicePeak("cuda") as peak:
        for size in (50, -50, 20, 30, -50):  # malloc 50, free it, malloc 20 and 30, free 50
            for hook in hooks:
                hook.malloc_postprocess(mem_size=size) if size > 0 else hook.free_postprocess(mem_size=-size)
    assert (peak.used, peak.peak) == (100, 150) and not hooks
    assert peak_memory_mb(2**20) == pytest.approx(peak_memory_mb() + 1.0, abs=0.5)
    assert DevicePeak("cpu").__enter__().peak == 0


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_embedding_gradients_on_the_device_equal_numpys(dtype):
    """NumPy sums repeated ids with add.reduceat; CuPy has none, so a GPU scatter-adds them."""
    from hpcpar.autograd.ops._common import scatter_add_rows

    rng = np.random.default_rng(0)
    ids, rows = rng.integers(0, 5, size=40), rng.standard_normal((40, 3)).astype(dtype)
    on_host = scatter_add_rows(ids, rows, (7, 3))
    on_device = scatter_add_rows(xp.asarray(ids), xp.asarray(rows), (7, 3))
    assert on_device.dtype == on_host.dtype == dtype
    np.testing.assert_allclose(backend.to_host(on_device), on_host, rtol=1e-3 if dtype == np.float16 else 1e-6)
