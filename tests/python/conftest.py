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
