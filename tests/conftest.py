import compileall
import os
import sys
import tempfile
import warnings

import pytest

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
TESTS = os.path.dirname(os.path.abspath(__file__))
# The shared helpers, for the tests in every folder below; the GPT of the example, the model
# most tests train.
sys.path[:0] = [TESTS, os.path.join(os.path.dirname(TESTS), "examples")]


def pytest_configure(config):
    """Byte-compile, once, the sources the suite's processes import. Where the environment
    sets PYTHONDONTWRITEBYTECODE (this workplace's machines do), no process writes what it
    compiled, and each of the suite's hundreds of processes compiled tiered's modules again:
    0.45 s of a CPU each, on two cores. A process reads what is written here whatever the
    variable says."""
    repo = os.path.dirname(TESTS)
    for folder in ("tiered", "examples", "bench", os.path.join("tests", "scripts")):
        compileall.compile_dir(os.path.join(repo, folder), quiet=1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def service_folder():
    """The node's tiered service of this test session: its own folder, not the user's (a
    launcher the tests run starts one there, or uses the one running), stopped at the end."""
    from tiered.service import stop_service
    from tiered.service.paths import RUNTIME_ENV

    with tempfile.TemporaryDirectory(prefix="tiered-service-") as folder:
        os.chmod(folder, 0o700)
        previous = os.environ.get(RUNTIME_ENV)
        os.environ[RUNTIME_ENV] = folder
        try:
            yield folder
        finally:
            stop_service(folder)
            if previous is None:
                os.environ.pop(RUNTIME_ENV, None)
            else:
                os.environ[RUNTIME_ENV] = previous
