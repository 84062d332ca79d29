"""tests/xdist_scheduling.py: the units it names are the suite's files, and which worker a
pinned unit goes to."""

from pathlib import Path

from tests import xdist_scheduling

ROOT = Path(__file__).resolve().parent.parent


def test_every_unit_handed_out_first_is_a_test_file_named_once():
    first = xdist_scheduling.LONGEST_FIRST
    assert len(set(first)) == len(first)
    assert all((ROOT / path).is_file() and Path(path).name.startswith("test_") for path in first)
    assert not set(first) & set(xdist_scheduling.PINS)


def test_pinned_units_and_their_workers():
    assert xdist_scheduling.scope_of("tests/cluster/cli/test_serve_command.py::test_x") == (
        xdist_scheduling.SERVED_SCOPE)
    assert xdist_scheduling.scope_of("tests/router/test_a.py::test_b") == "tests/router/test_a.py"
    assert xdist_scheduling.owner(xdist_scheduling.SERVED_SCOPE, 2) == "gw0"
    assert xdist_scheduling.owner(xdist_scheduling.NODES_SCOPE, 2) == "gw1"
    assert xdist_scheduling.owner(xdist_scheduling.NODES_SCOPE, 1) == "gw0"
