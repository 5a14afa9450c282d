import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One intra-op thread in every test process: on a 2-core machine with other load, torch's
# thread pool turns sub-millisecond steps into noisy multi-millisecond ones.
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def records_of():
    """Reads a log back, validating every record against the schema."""
    import steptrace

    def read(path):
        return list(steptrace.read(path, validate=True))

    return read


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory):
    """The stand-in libnvidia-ml.so.1 of the C++ tests, compiled here: point
    STEPTRACE_NVML_LIBRARY at it and pick a series with STEPTRACE_FAKE_NVML_SCENARIO."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the stand-in NVML library")
    lib = tmp_path_factory.mktemp("fake_nvml") / "libnvidia-ml.so.1"
    src = Path(__file__).parent.parent / "cpp" / "fake_nvml" / "fake_nvml.cpp"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-o", str(lib), str(src)],
                   check=True)
    return lib
