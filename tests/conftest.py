import pytest
import torch

from fairseq_cli_utils import preprocess, write_reversal_corpus


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no CUDA GPU (``make gpu-check`` selects
    them with ``-m cuda``). On a pytest-xdist worker (whose collection the controller hands
    out) the files are put in the order the workers should get them
    (:func:`slow_files_first`)."""
    if hasattr(config, "workerinput"):
        items[:] = slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def slow_files_first(items):
    """The items file by file: files holding a test marked ``slow`` (an end-to-end run, a
    compilation) first, then the others; within each group, files with more tests first
    (pytest-xdist's own order), ties in collection order. With ``--no-loadscope-reorder``
    (Makefile) xdist hands the files out in this order, so a long file is not handed out
    last and run alone while the other worker has finished (docs/tests.md)."""
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def key(file_items):
        slow = any(i.get_closest_marker("slow") is not None for i in file_items)
        return (not slow, -len(file_items))

    return [item for file_items in sorted(by_file.values(), key=key) for item in file_items]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Binarized tiny reversal corpus (joined dictionary), shared by the CLI tests."""
    root = tmp_path_factory.mktemp("tiny_data")
    write_reversal_corpus(root / "raw")
    return preprocess(root / "raw", root / "bin")


@pytest.fixture(scope="session")
def tiny_raw(tiny_data):
    return tiny_data.parent / "raw"
