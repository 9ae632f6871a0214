"""Repository-wide test setup: every test starts from the process's default float environment."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _default_float_environment():
    # Training code may switch on flush-to-zero for speed (denormals from quantised weights);
    # hypothesis refuses to generate floats when subnormals cannot be represented.
    yield
    torch.set_flush_denormal(False)
