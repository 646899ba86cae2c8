import pytest
import torch

import attn_export  # noqa: F401  (loads the operators)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU and the CUDA build of attn_export")
    if not torch.cuda.is_available():
        for item in items:
            # The marker itself: item.keywords also holds every parent node's name, so a
            # checkout in a directory named "cuda" would otherwise skip the whole suite.
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip_cuda)
