import os
import zlib

import pytest
import torch

import attn_export  # noqa: F401  (loads the operators)


def _threads_per_worker() -> int:
    """The cores each pytest-xdist worker may use: under `make test` two workers share two
    cores, and a worker's second thread (torch's OpenMP pool, ONNX Runtime's spinning intra-op
    pool) only waits, spinning, while the other worker's process wants the core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


# Set before any test runs and inherited by the processes tests start (the validation worker,
# the CLI): torch's and OpenMP's thread pools, and ONNX Runtime's sessions that name no thread
# count. Tests of threading set their own counts (test_flash_cpu.py, test_cpu_projection.py).
THREADS = _threads_per_worker()
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    torch.set_num_threads(THREADS)


def _ort_sessions_share_the_cores() -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        return
    session_init = ort.InferenceSession.__init__

    def init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        options = sess_options if sess_options is not None else ort.SessionOptions()
        if options.intra_op_num_threads == 0:  # ONNX Runtime's default: every core, spinning
            options.intra_op_num_threads = THREADS
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session_init(self, path_or_bytes, options, *args, **kwargs)

    ort.InferenceSession.__init__ = init


if "PYTEST_XDIST_WORKER" in os.environ:
    _ort_sessions_share_the_cores()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# `make test` hands whole files to two workers in collection order (--dist loadfile
# --no-loadscope-reorder): the files of slow tests go first, which leaves only short files for
# the end, so neither worker idles while the other finishes a long one. `make test-fast` leaves
# the slow tests out.
#
# First, before the other slow files, one on each worker: the CMake build of the CUDA kernels
# (test_cuda_build.py) and the CUDA emulator's file, whose first test builds the emulator (~150 s
# of a core). Every other emulator file waits on that build's lock: dealt in collection order, one
# of them started on the other worker while the build ran and idled ~80 s; started first, the
# build is done before any other emulator file comes up.
LONGEST_FIRST = ("tests/ops/cuda/test_cuda_build.py", "tests/ops/cuda/test_cuda_emulator.py")


def _run_order(item) -> tuple[bool, bool]:
    return (item.nodeid.split("::")[0] not in LONGEST_FIRST, item.get_closest_marker("slow") is None)


def _selects(params: dict, item) -> bool:
    """Whether `params` (name -> value, a subset of the test's parameters) picks this case."""
    given = getattr(item, "callspec", None)
    given = given.params if given is not None else {}
    return all(name in given and given[name] == value for name, value in params.items())


def _mark_sm90_quick(items) -> None:
    """The Hopper GPU tests' quick tier (gpu_check.sh's sm90quick step, docs/testing.md): the
    cases a module lists in SM90_QUICK, (test name, parameters picking one case), get the mark
    sm90_quick. Lists of parameters rather than node ids: a renamed id or a new parameter
    value cannot unselect a case silently (tests/ops/cuda/test_cuda_sm90_quick.py counts them)."""
    for item in items:
        quick = getattr(getattr(item, "module", None), "SM90_QUICK", ())
        if any(item.originalname == name and _selects(params, item) for name, params in quick):
            item.add_marker(pytest.mark.sm90_quick)


def pytest_collection_modifyitems(config, items):
    for item in items:  # an exhaustive test is a slow one: `make test-fast` (-m "not slow") leaves it out
        if item.get_closest_marker("exhaustive") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    _keep_shard(config, items)
    # Stable: the order within a file, and among the rest, is kept.
    items.sort(key=_run_order)
    _mark_sm90_quick(items)
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU and the CUDA build of attn_export")
    if not torch.cuda.is_available():
        for item in items:
            # The marker itself: item.keywords also holds every parent node's name, so a
            # checkout in a directory named "cuda" would otherwise skip the whole suite.
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip_cuda)


def _keep_shard(config, items) -> None:
    """ATTN_EXPORT_TEST_SHARD=k/n keeps the tests whose id hashes to k of n (test_instruction_sets.py
    runs one such share of the kernel tests per lower instruction set in CI, the others in
    `make test-all`)."""
    shard = os.environ.get("ATTN_EXPORT_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    keep = [zlib.crc32(item.nodeid.encode()) % count == index for item in items]
    config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
    items[:] = [item for item, k in zip(items, keep) if k]


@pytest.fixture(scope="session")
def small_seq2seq():
    """The bundled example architecture, small: 1 encoder + 1 decoder layer, d_model 16, 2 heads
    (3 attention layers: encoder self, decoder causal self, decoder cross)."""
    from attn_export.examples import TinySeq2Seq

    torch.manual_seed(0)
    return TinySeq2Seq(features=8, d_model=16, heads=2, layers=1).eval()


@pytest.fixture(scope="session")
def exported_seq2seq(small_seq2seq, tmp_path_factory):
    """small_seq2seq exported once per session (fp32, default dynamic axes)."""
    from attn_export.onnx import export_onnx

    path = tmp_path_factory.mktemp("export") / "seq2seq.onnx"
    return export_onnx(small_seq2seq, small_seq2seq.example_inputs, path)


def _cache_torchlib_ops(mp: pytest.MonkeyPatch) -> None:
    """Every ``torch.onnx.export`` rebuilds its registry from onnxscript's torchlib, re-parsing
    the source of ~500 functions (~2 s of the ~3 s a small export takes here). The list is the
    same every time: compute it once. The registry itself (and everything attn-export does) is
    still built per export."""
    import functools
    import importlib

    try:  # the onnxscript module torch's exporter uses (torch_2_11 with torch 2.13)
        from torch.onnx._internal._lazy_import import onnxscript_apis

        apis = importlib.import_module(getattr(onnxscript_apis, "_name", None) or onnxscript_apis.__name__)
        mp.setattr(apis, "get_torchlib_ops", functools.lru_cache(maxsize=None)(apis.get_torchlib_ops))
    except (ImportError, AttributeError):  # another torch: no shortcut, only slower
        pass


@pytest.fixture(scope="session", autouse=True)
def _torchlib_ops_cached():
    """The torchlib list once per test process, for every test that exports (CI time)."""
    with pytest.MonkeyPatch.context() as mp:
        _cache_torchlib_ops(mp)
        yield


@pytest.fixture(scope="module")
def torchlib_ops_once():
    """For modules that export many small models: torch runs single-threaded meanwhile (tiny
    models, and a second thread only waits on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
