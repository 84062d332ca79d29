"""A step's end through a FIFO a rank: the replica waits for every rank's byte without
polling, wakes at once when a shard dies, and never on a byte of an earlier step."""

import os
import subprocess
import sys
import threading

from cluster.ray.step_notice import StepNotices, StepNoticeSender


def test_the_wait_ends_when_every_rank_has_told_its_step_s_end():
    notices = StepNotices(2)
    try:
        senders = [StepNoticeSender() for _ in notices.paths]
        assert all(s.connect(path) for s, path in zip(senders, notices.paths, strict=True))
        senders[1].send()
        assert notices.wait(limit_s=0.05) == "late"  # rank 0 has not finished: no early wake
        senders[0].send()
        senders[1].send()
        assert notices.wait(limit_s=60) == "told"
        for _ in range(3):  # a late byte of a step whose wait gave up
            senders[0].send()
        notices.drain()
        assert notices.wait(limit_s=0.05) == "late"  # nothing stale wakes the next step
        done = threading.Event()

        def wait() -> None:
            if notices.wait(limit_s=60) == "told":
                done.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert not done.wait(0.05)
        for sender in senders:
            sender.send()
        waiter.join(60)
        assert done.is_set()
        for sender in senders:
            sender.close()
    finally:
        notices.close()
    assert not os.path.exists(notices.folder)


def test_a_shard_that_dies_wakes_the_wait_at_once():
    notices = StepNotices(1)
    try:
        # another process holds the write end, as a shard does, then exits without a word
        code = (f"import os, time; fd = os.open({notices.paths[0]!r}, os.O_WRONLY); "
                "time.sleep(0.2)")
        child = subprocess.Popen([sys.executable, "-c", code])
        assert notices.wait(limit_s=600) == "closed"
        assert child.wait(60) == 0
    finally:
        notices.close()


def test_a_shard_on_another_node_polls_as_before():
    sender = StepNoticeSender()
    assert not sender.connect("/nonexistent/tandem-steps/rank0")
    sender.send()  # nothing to tell: no error
    notices = StepNotices(1)
    path = notices.paths[0]
    assert sender.connect(path)
    notices.close()  # the replica went: the shard's next notice closes its end quietly
    sender.send()
    assert sender.fd is None
