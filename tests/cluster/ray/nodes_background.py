"""The nodes scenario (nodes_scenario.py) started as the session's collection ends, so that it
runs beside the rest of the suite instead of after it: it spends most of its time waiting
for Ray nodes to start, join and idle away, not computing. test_nodes.py waits for its report.

The scenario builds nothing of the session's: its model is the tiny llama of
tests/tiny_models.py, built here into a folder of its own (the same seed gives the same
weights), and its Ray cluster is its own (nodes of this machine with ports of their own).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TEST_FILE = "tests/cluster/ray/test_nodes.py"
MODEL = "llama"


class BackgroundScenario:
    def __init__(self) -> None:
        self.folder: Path | None = None
        self.process: subprocess.Popen | None = None

    @property
    def model(self) -> Path:
        assert self.folder is not None
        return self.folder / MODEL

    @property
    def report(self) -> Path:
        assert self.folder is not None
        return self.folder / "report.json"

    def start(self) -> None:
        from tests.tiny_models import build_tiny_model

        self.folder = Path(tempfile.mkdtemp(prefix="tandem-nodes-"))
        build_tiny_model(MODEL, self.folder)
        # none of the test session's Ray settings: its ray.init sets RAY_AUTH_MODE=token, and a
        # driver started with it on a cluster without auth has every actor it creates
        # destroyed before it runs ("all references to the actor were removed")
        env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.ray.nodes_scenario", str(self.model),
             str(self.report)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=open(self.folder / "stderr.txt", "w"))  # noqa: SIM115 - the process's

    def wait(self, timeout_s: float) -> tuple[int, str]:
        """The scenario's exit code and the tail of its stderr, once it has ended (started
        now if the collection hook did not start it: a test run by itself)."""
        if self.process is None:
            self.start()
        assert self.process is not None and self.folder is not None
        returncode = self.process.wait(timeout_s)
        return returncode, (self.folder / "stderr.txt").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        """Ends a scenario still running (the session ended first: -x, Ctrl-C); SIGTERM lets
        it stop the Ray nodes it started."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


SCENARIO = BackgroundScenario()
