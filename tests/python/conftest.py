import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def records_of():
    """Reads a log back, validating every record against the schema."""
    import steptrace

    def read(path):
        return list(steptrace.read(path, validate=True))

    return read
