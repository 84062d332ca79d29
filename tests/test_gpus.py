"""tests/gpus.py's decision, on the CPU: a test marked ``gpu(gpus=N)`` is skipped, with the
reason, where fewer than N GPUs are present, and runs where enough are."""

import pytest

from tests.gpus import gpu_shortage, gpus_needed, skip_without_gpus


class Item:
    """A collected test as the helper sees it: its id, its marks, and add_marker."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.nodeid = "tests/test_x.py::test_x"
        self.marks = [m.mark for m in marks]

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.mark)


def skip_reasons(items: list[Item], present: int) -> list[str | None]:
    asked = []
    skip_without_gpus(items, lambda: asked.append(1) or present)  # type: ignore[arg-type]
    assert len(asked) == 1  # counted once for all the tests
    reasons = [item.get_closest_marker("skip") for item in items]
    return [None if mark is None else mark.kwargs["reason"] for mark in reasons]


def test_a_two_gpu_test_on_one_gpu_is_skipped_with_the_reason():
    def items():
        return [Item(pytest.mark.gpu(gpus=2)), Item(pytest.mark.gpu), Item(pytest.mark.ray)]

    assert skip_reasons(items(), 1) == ["needs 2 GPUs, this machine has 1", None, None]
    assert skip_reasons(items(), 0) == ["needs 2 GPUs, this machine has 0",
                                        "needs 1 GPU, this machine has 0", None]
    assert skip_reasons(items(), 2) == [None, None, None]
    assert [gpus_needed(item) for item in items()] == [2, 1, 0]  # type: ignore[arg-type]
    assert gpu_shortage(4, 2) == "needs 4 GPUs, this machine has 2" and gpu_shortage(4, 8) is None


def test_without_gpu_tests_the_gpus_are_not_counted():
    def never() -> int:
        raise AssertionError("counted the GPUs for tests that need none")

    skip_without_gpus([Item(pytest.mark.ray), Item()], never)  # type: ignore[list-item]


@pytest.mark.parametrize("mark", [pytest.mark.gpu(2), pytest.mark.gpu(gpus=0),
                                  pytest.mark.gpu(gpu=2)])
def test_a_miswritten_gpu_marker_is_an_error_not_a_silent_run(mark):
    with pytest.raises(ValueError, match=r"^tests/test_x.py::test_x: write @pytest.mark.gpu or "
                       r"@pytest.mark.gpu\(gpus=N\) with N >= 1, not "):
        gpus_needed(Item(mark))  # type: ignore[arg-type]


def test_the_two_gpu_tests_say_they_need_two():
    """The tests that start TP=2 (Ray shards, or two processes) carry gpus=2."""
    from tests.workers import test_tp_graphs

    for test in (test_tp_graphs.test_tensor_parallel_graph_replay_matches_eager,
                 test_tp_graphs.test_peer_memory_sums_equal_nccl_at_decode_sizes):
        (mark,) = [m for m in test.pytestmark if m.name == "gpu"]
        assert mark.kwargs == {"gpus": 2}
