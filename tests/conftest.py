import pytest
import torch

from fairseq_cli_utils import preprocess, write_reversal_corpus


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no CUDA GPU (``make gpu-check`` selects
    them with ``-m cuda``)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Binarized tiny reversal corpus (joined dictionary), shared by the CLI tests."""
    root = tmp_path_factory.mktemp("tiny_data")
    write_reversal_corpus(root / "raw")
    return preprocess(root / "raw", root / "bin")


@pytest.fixture(scope="session")
def tiny_raw(tiny_data):
    return tiny_data.parent / "raw"
