import pytest

from fairseq_cli_utils import preprocess, write_reversal_corpus


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Binarized tiny reversal corpus (joined dictionary), shared by the CLI tests."""
    root = tmp_path_factory.mktemp("tiny_data")
    write_reversal_corpus(root / "raw")
    return preprocess(root / "raw", root / "bin")


@pytest.fixture(scope="session")
def tiny_raw(tiny_data):
    return tiny_data.parent / "raw"
