import os

# before torch loads its OpenMP runtime, which reads this once: threads that wait for work sleep
# instead of spinning. The README's command runs two pytest workers on two cores, and a job measured
# in a worker (or in the sweeps tests start) uses every core: a spinning thread then holds the core
# the other worker's thread needs, and the test file of in-process fwd+bwd jobs took 260 s in the
# suite against 29 s alone on this project's 2-core VM (79 s beside one busy core, 38 s passive).
# Tests measure no speed goal; the benchmarks (benchmarks/) run alone and keep OpenMP's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import variants
from experiments.sweep.concurrency import RUNNING_DIR_ENV

# tests are small; two threads keep them steady on a shared 2-core machine, and with pytest-xdist's
# workers (the README's test command runs two) the cores are shared among them, not oversubscribed
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(autouse=True, scope="session")
def _own_running_dir(tmp_path_factory):
    # the sweeps these tests start (and the subprocesses they run) mark themselves as measuring in a
    # folder of their own: another sweep measuring on the host is invisible to them, so what they
    # assert about concurrency, settling and retries is the same on a busy machine and a quiet one
    before = os.environ.get(RUNNING_DIR_ENV)
    os.environ[RUNNING_DIR_ENV] = str(tmp_path_factory.mktemp("running"))
    yield
    if before is None:
        os.environ.pop(RUNNING_DIR_ENV, None)
    else:
        os.environ[RUNNING_DIR_ENV] = before


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    # a job measured in this process sets torch's threads to its own count (every CPU it may use):
    # put them back, so that no test depends on which ran before it
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # a library this machine lacks (xformers not installed, or built for another torch) is a fact
    # about the machine: such a test is skipped with the library's reason, never passed or failed
    try:
        return (yield)
    except variants.Unavailable as exc:
        pytest.skip(f"unavailable here: {exc}")
