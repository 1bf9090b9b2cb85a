"""The order in which ``make test`` hands the test files to its workers (tests/conftest.py,
docs/tests.md): files holding a test marked ``slow`` first, then the rest, each group by
number of tests, so that no long file is handed out last."""
import re

import pytest

from conftest import slow_files_first
from fairseq_cli_utils import REPO


class FakeItem:
    def __init__(self, nodeid, slow=False):
        self.nodeid = nodeid
        self.slow = slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


def test_slow_files_go_out_first_then_by_number_of_tests():
    items = (
        [FakeItem(f"tests/test_a.py::t{i}") for i in range(4)]
        + [FakeItem("tests/test_b.py::t0", slow=True)]
        + [FakeItem(f"tests/test_c.py::t{i}") for i in range(2)]
        + [FakeItem("tests/test_d.py::t0"), FakeItem("tests/test_d.py::t1[x]", slow=True),
           FakeItem("tests/test_d.py::t2")]
        + [FakeItem(f"tests/test_e.py::t{i}") for i in range(2)]
    )
    ordered = slow_files_first(items)
    assert sorted(ordered, key=id) == sorted(items, key=id)
    files = [i.nodeid.split("::")[0][len("tests/test_"):-3] for i in ordered]
    assert "".join(dict.fromkeys(files)) == "dbace"
    # each file's tests stay together and in their own order
    assert [i.nodeid for i in ordered[:3]] == ["tests/test_d.py::t0", "tests/test_d.py::t1[x]",
                                               "tests/test_d.py::t2"]


def test_make_test_keeps_that_order():
    # without --no-loadscope-reorder pytest-xdist sorts the files by number of tests again
    recipe = re.search(r"^test:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    args = recipe.group(1).split()
    assert {"--dist", "loadfile", "--no-loadscope-reorder"} <= set(args)
    assert args[args.index("--dist") + 1] == "loadfile"
