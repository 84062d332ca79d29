"""Block files written and read on the disk thread, off the step: a step returns while its
files are still being written or read, a load waits for its reads (and an idle step for the
oldest), a cancelled load is never copied, and a file is visible only once renamed whole."""

import threading

import torch

import kvstore.block_file
import workers.disk_io
from kvstore.block_file import block_file_name
from kvstore.transfers import BlockLoad, DiskRead, DiskWrite, KVTransfers
from tests.workers.test_kv_offload import bits, blocks_of, caches, hashes, step
from workers.host_layout import layer_tensors
from workers.kv_offload import KVOffloader
from workers.layers.parallel import TensorParallelGroup

WAIT_S = 120  # for the other thread: generous, a busy machine may be slow to run it


def gated(monkeypatch, module, name):
    """``module.name`` waits for the returned event before doing its work; ``gate.reached``
    is set once the disk thread waits there."""
    gate, real = threading.Event(), getattr(module, name)
    gate.reached = threading.Event()

    def held(*args, **kwargs):
        gate.reached.set()
        assert gate.wait(WAIT_S), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    return gate


def offloader_with_files(tmp_path, num_slots=4):
    """Blocks 0 and 1 written to disk (and flushed), then every cache and slot zeroed."""
    tensors = layer_tensors(caches(torch.float32, seed=7))
    offloader = KVOffloader(tensors, num_slots=num_slots, disk_dir=str(tmp_path),
                            tp=TensorParallelGroup.single())
    originals = blocks_of(tensors, [0, 1])
    h = hashes(2)
    step(offloader, KVTransfers(stores=[(0, 0), (1, 1)]))
    step(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (0,)), DiskWrite(1, h[1], (1,))]))
    offloader.host.zero_()
    for t in tensors:
        t.zero_()
    return offloader, tensors, originals, h


def unflushed(offloader, transfers, idle=False):
    offloader.before_step(transfers, [], [])
    offloader.after_step(transfers)
    return offloader.report(idle=idle)


def test_a_step_returns_while_its_file_is_written_and_the_file_appears_whole_after(
        tmp_path, monkeypatch):
    tensors = layer_tensors(caches(torch.float32, seed=5))
    offloader = KVOffloader(tensors, num_slots=2, disk_dir=str(tmp_path),
                            tp=TensorParallelGroup.single())
    h = hashes(1)
    step(offloader, KVTransfers(stores=[(3, 0)]))
    slot_bytes = offloader.host[0].clone()
    gate = gated(monkeypatch, kvstore.block_file.os, "replace")
    report = unflushed(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (9,))]))
    # the step wrote slot 0 again right after: the file holds the bytes it had when queued
    unflushed(offloader, KVTransfers(stores=[(4, 0)]))
    assert gate.reached.wait(WAIT_S)
    directory = offloader.directory
    path = directory / block_file_name(h[0], 0, 1)
    temps = [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert report.disk_error is None and not path.exists() and len(temps) == 1
    gate.set()
    offloader.flush()
    assert not temps[0].exists() and path.exists()
    into = torch.empty_like(slot_bytes)
    assert kvstore.block_file.read_block_file(path, h[0], offloader.layout.tag, (9,),
                                              memoryview(into.numpy())) is None
    assert torch.equal(into, slot_bytes) and not torch.equal(slot_bytes, offloader.host[0])


def test_a_load_from_disk_waits_for_its_reads_while_steps_go_on(tmp_path, monkeypatch):
    offloader, tensors, originals, h = offloader_with_files(tmp_path)
    gate = gated(monkeypatch, workers.disk_io, "read_block_file")
    reads = KVTransfers(from_disk=[DiskRead(h[1], (1,), 2), DiskRead(h[0], (0,), 3)],
                        loads=[BlockLoad("r", [3, 2], [5, 6]),
                               BlockLoad("host", [1], [7])])  # no file: copied now
    assert unflushed(offloader, reads).loaded == {"host": 1}
    assert unflushed(offloader, None).loaded == {}  # the files are still being read
    assert all(not bits(t[[5, 6]]).any() for t in tensors)
    gate.set()
    offloader.flush()
    assert unflushed(offloader, None).loaded == {"r": 2}
    assert all(torch.equal(a, b) for a, b in zip(originals, blocks_of(tensors, [5, 6]),
                                                 strict=True))


def test_an_idle_step_waits_for_the_oldest_load_s_reads(tmp_path, monkeypatch):
    offloader, tensors, originals, h = offloader_with_files(tmp_path)
    gate = gated(monkeypatch, workers.disk_io, "read_block_file")
    real_wait = workers.disk_io.ReadJob.wait

    def wait_opening_the_gate(job):  # the reads land only once the idle step waits for them
        gate.set()
        real_wait(job)

    monkeypatch.setattr(workers.disk_io.ReadJob, "wait", wait_opening_the_gate)
    report = unflushed(offloader, KVTransfers(from_disk=[DiskRead(h[0], (0,), 2)],
                                              loads=[BlockLoad("r", [2], [4])]), idle=True)
    assert report.loaded == {"r": 1}
    assert all(torch.equal(a, b[:1]) for a, b in zip(blocks_of(tensors, [4]), originals,
                                                      strict=True))


def test_a_load_cancelled_while_its_file_is_read_is_never_copied(tmp_path, monkeypatch):
    offloader, tensors, _, h = offloader_with_files(tmp_path)
    gate = gated(monkeypatch, workers.disk_io, "read_block_file")
    unflushed(offloader, KVTransfers(from_disk=[DiskRead(h[0], (0,), 2)],
                                     loads=[BlockLoad("r", [2], [4])]))
    for t in tensors:  # block 4 is handed out again, and written by a step
        t[4].fill_(3)
    before = blocks_of(tensors, [4])
    unflushed(offloader, KVTransfers(cancelled=["r"]))
    gate.set()
    offloader.flush()
    assert unflushed(offloader, None).loaded == {}
    assert all(torch.equal(a, b) for a, b in zip(before, blocks_of(tensors, [4]), strict=True))
    assert not offloader.disk.waiting and not offloader.disk.reading


def test_a_host_load_of_a_slot_still_being_read_waits_for_that_read(tmp_path, monkeypatch):
    offloader, tensors, originals, h = offloader_with_files(tmp_path)
    gate = gated(monkeypatch, workers.disk_io, "read_block_file")
    unflushed(offloader, KVTransfers(from_disk=[DiskRead(h[1], (1,), 2)],
                                     loads=[BlockLoad("first", [2], [4])]))
    # another sequence finds the block in the host tier (its slot taken) before it landed
    assert unflushed(offloader, KVTransfers(loads=[BlockLoad("second", [2], [5])])).loaded \
        == {}
    gate.set()
    offloader.flush()
    assert unflushed(offloader, None).loaded == {"first": 1, "second": 1}
    assert all(torch.equal(a, b[1:]) and torch.equal(c, b[1:])
               for a, c, b in zip(blocks_of(tensors, [4]), blocks_of(tensors, [5]),
                                  originals, strict=True))


def test_a_refused_read_stops_a_later_host_load_of_its_slot_too(tmp_path):
    offloader, tensors, _, h = offloader_with_files(tmp_path)
    path = offloader.directory / block_file_name(h[0], 0, 1)
    path.write_bytes(path.read_bytes()[:-8])
    report = step(offloader, KVTransfers(from_disk=[DiskRead(h[0], (0,), 2)],
                                         loads=[BlockLoad("first", [2], [4])]))
    assert report.loaded == {"first": 0} and report.failed_reads == [h[0]]
    # planned before the engine heard: the slot is refused until written again
    assert step(offloader, KVTransfers(loads=[BlockLoad("second", [2], [5])])).loaded == {
        "second": 0}
    step(offloader, KVTransfers(stores=[(1, 2)]))
    assert step(offloader, KVTransfers(loads=[BlockLoad("third", [2], [5])])).loaded == {
        "third": 1}


def test_a_file_evicted_while_its_write_is_queued_is_deleted_once_written(tmp_path,
                                                                           monkeypatch):
    tensors = layer_tensors(caches(torch.float32, seed=5))
    offloader = KVOffloader(tensors, num_slots=2, disk_dir=str(tmp_path),
                            tp=TensorParallelGroup.single())
    h = hashes(1)
    step(offloader, KVTransfers(stores=[(3, 0)]))
    gate = gated(monkeypatch, kvstore.block_file.os, "replace")
    unflushed(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (9,))]))
    # the disk tier evicted the block before its file landed: the delete queues after it
    unflushed(offloader, KVTransfers(disk_deletes=[h[0]]))
    assert gate.reached.wait(WAIT_S)
    gate.set()
    offloader.flush()
    assert list(offloader.directory.iterdir()) == []  # neither the file nor a temporary one
