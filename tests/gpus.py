"""How many GPUs a test needs, and its skip where fewer are present.

``@pytest.mark.gpu`` needs one GPU, ``@pytest.mark.gpu(gpus=2)`` two (TP=2 over Ray, two
processes of one GPU each). tests/conftest.py hands the collected tests to
``skip_without_gpus``: on a machine with too few GPUs such a test is skipped with the reason
("needs 2 GPUs, this machine has 1") instead of failing on a placement that can never be met,
and none of its fixtures (Ray, the tiny models) is set up for it. Tests without the marker are
left alone.
"""

from collections.abc import Callable, Iterable

import pytest


def gpu_shortage(needed: int, present: int) -> str | None:
    """The reason to skip a test that needs ``needed`` GPUs where ``present`` are; None if
    enough are."""
    if present >= needed:
        return None
    return f"needs {needed} GPU{'' if needed == 1 else 's'}, this machine has {present}"


def gpus_needed(item: pytest.Item) -> int:
    """0 for a test without the gpu marker; else its ``gpus`` (1 when not given)."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return 0
    needed = marker.kwargs.get("gpus", 1)
    if marker.args or set(marker.kwargs) - {"gpus"} or not isinstance(needed, int) \
            or needed < 1:
        raise ValueError(f"{item.nodeid}: write @pytest.mark.gpu or @pytest.mark.gpu(gpus=N) "
                         f"with N >= 1, not {marker}")
    return needed


def skip_without_gpus(items: Iterable[pytest.Item],
                      device_count: Callable[[], int] | None = None) -> None:
    """Marks each test of ``items`` that needs more GPUs than are present to be skipped, with
    the reason. device_count (default torch.cuda.device_count) is asked once, and only when
    some test needs GPUs."""
    present = None
    for item in items:
        needed = gpus_needed(item)
        if needed == 0:
            continue
        if present is None:
            if device_count is None:
                import torch

                device_count = torch.cuda.device_count
            present = device_count()
        reason = gpu_shortage(needed, present)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
