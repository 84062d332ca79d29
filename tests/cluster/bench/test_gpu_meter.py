"""GpuMeter: each GPU's mean utilization over a load, from nvidia-smi's samples."""

import os

from cluster.bench import gpu_meter
from cluster.bench.gpu_meter import GpuMeter, mean_busy


def test_samples_are_averaged_per_gpu_and_broken_lines_left_out():
    lines = ["0, 50", "1, 0", "0, 100", "1, 30", "0, [N/A]", "", "0, 7", "1"]
    assert mean_busy(lines) == {0: (0.5 + 1.0 + 0.07) / 3, 1: 0.15}
    assert mean_busy([]) == {}


def test_without_nvidia_smi_there_is_no_figure(monkeypatch):
    monkeypatch.setattr(gpu_meter.shutil, "which", lambda name: None)
    assert GpuMeter().busy() is None


def test_the_meter_reads_what_nvidia_smi_printed_with_its_arguments(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@" > "$0.args"\nprintf "0, 40\\n0, 60\\n1, 90\\n"\n')
    os.chmod(fake, 0o755)
    monkeypatch.setattr(gpu_meter.shutil, "which", lambda name: str(fake))
    meter = GpuMeter()
    assert meter.process is not None
    meter.process.wait()  # this one prints its samples and ends (the real one runs on)
    assert meter.busy() == {0: 0.5, 1: 0.9}
    assert (tmp_path / "nvidia-smi.args").read_text().split() == [
        "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "--loop-ms=100"]
