"""How the suite's tests are shared among pytest-xdist's workers (`make test` runs `pytest -n 2`).

A work unit is a test file, so that a module's fixtures (an ``LLM`` of the default model, a
Serve app, a Ray cluster) are built once, by one worker. Two units are pinned to a worker:
the files of tests/cluster/cli, which share the `tandem serve` process (one unit: its last
test stops the server), and tests/cluster/ray/test_nodes.py, whose scenario runs in a
process of its own. The worker that a unit is pinned to starts that process as its
collection ends (tests/conftest.py), so that it runs beside that worker's earlier tests, as
in a run without workers; no other worker starts it or is given the unit.
"""

import os

SERVED_SCOPE = "tests/cluster/cli"  # the files that share the `tandem serve` process
NODES_SCOPE = "tests/cluster/ray/test_nodes.py"
PINS = {SERVED_SCOPE: 0, NODES_SCOPE: 1}  # unit -> index of the worker it runs on


def owner(scope: str, num_workers: int) -> str:
    """The id of the worker that ``scope`` is pinned to ("gw0", "gw1", ...)."""
    return f"gw{PINS[scope] % max(num_workers, 1)}"


def runs_here(scope: str) -> bool:
    """Whether this process runs ``scope``'s tests: every process without xdist's workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return True
    return worker == owner(scope, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SERVED_SCOPE if path.startswith(SERVED_SCOPE + "/") else path


def pinned_file_scheduling(config, log):  # type: ignore[no-untyped-def]
    """A PinnedFileScheduling (made here: this module is imported where xdist is not)."""
    from xdist.scheduler import LoadScopeScheduling

    class PinnedFileScheduling(LoadScopeScheduling):
        """xdist's --dist loadfile, but a pinned unit goes only to its worker."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _takes(self, scope: str, node) -> bool:  # type: ignore[no-untyped-def]
            if scope not in PINS:
                return True
            # by rank among the live workers' ids: a worker that crashed is replaced by "gw<n>"
            ids = sorted((n.gateway.id for n in self.nodes), key=lambda id_: int(id_[2:]))
            return ids[PINS[scope] % len(ids)] == node.gateway.id

        def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
            """The first unit of the queue this node may take, if any: every test of it.
            Not by xdist's ``collection.index(nodeid)``, which sends only the first of
            several items of one id (schemathesis' cases, one a route, share theirs)."""
            scope = next((s for s in self.workqueue if self._takes(s, node)), None)
            if scope is None:
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            node.send_runtest_some([
                index for index, nodeid in enumerate(self.registered_collections[node])
                if nodeid in work_unit and not work_unit[nodeid]])

        def _reschedule(self, node) -> None:  # type: ignore[no-untyped-def]
            if node.shutting_down:
                return
            if not any(self._takes(scope, node) for scope in self.workqueue):
                node.shutdown()  # nothing left that it may take: it ends after its last test
                return
            if self._pending_of(self.assigned_work.get(node, {})) > 2:
                return
            self._assign_work_unit(node)

    return PinnedFileScheduling(config, log)


class XdistScheduling:
    """Registered as a plugin by tests/conftest.py where xdist runs."""

    def pytest_xdist_make_scheduler(self, config, log):  # type: ignore[no-untyped-def]
        return pinned_file_scheduling(config, log)
