"""Graceful drain for `tandem serve`: on SIGTERM (or Ctrl-C) stop taking requests, let the
ones in flight finish within ``drain_timeout``, then exit.

The router refuses new requests from the moment the drain starts (503 ``draining`` with
Retry-After, and /health says ``draining``, so a load balancer moves on), while requests
already placed — and their continuations after a failover — go on. When none is left, or the
timeout has passed, Serve is shut down; what was cut off is counted on stderr, never dropped
silently. A second signal during the drain stops waiting.
"""

import asyncio
import contextlib
import signal
import sys
import time


class ShutdownRequested(BaseException):  # noqa: N818 - raised by a signal, like KeyboardInterrupt
    """A signal asked the server to stop; a BaseException, so that no ``except Exception`` in
    the code it interrupts swallows it."""


def raise_on_signals() -> None:
    def stop(signum: int, _frame: object) -> None:
        raise ShutdownRequested(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def drain_and_stop(timeout_s: float, app_name: str) -> None:
    """Drains the app's cluster, then shuts Serve down."""
    asyncio.run(_drain_and_report(timeout_s, app_name))
    print("tandem: shutting down", flush=True)
    stop_serve()


async def _drain_and_report(timeout_s: float, app_name: str) -> None:
    second_signal = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, second_signal.set)
    started = time.monotonic()
    left = await _drain(timeout_s, app_name, second_signal)
    took = time.monotonic() - started
    if left:
        print(f"tandem: {left} request(s) still running after {took:.1f} s of draining are cut "
              "off", file=sys.stderr, flush=True)
    else:
        print(f"tandem: drained in {took:.1f} s", flush=True)


async def _drain(timeout_s: float, app_name: str, stop_waiting: asyncio.Event) -> int:
    """How many requests were still running when the drain ended. The app's routers are
    found by name (router_actor.py), not through a Serve handle: a handle in this process
    would keep a call waiting on Serve's controller, which fails as the controller exits
    ("Task ServeController.listen_for_change failed")."""
    from cluster.ray.router_actor import find_routers
    from cluster.ray.tandem_cluster import drain_routers

    routers = []
    for address in find_routers(app_name):
        with contextlib.suppress(ValueError):  # gone since it was listed
            routers.append(address.lookup())
    if not routers:  # stopped while loading: no engines to drain yet
        print("tandem: nothing to drain (the engines were not up yet)", flush=True)
        return 0
    print(f"tandem: draining (new requests get 503; up to {timeout_s:.0f} s for those in "
          "flight)", flush=True)
    draining = asyncio.ensure_future(drain_routers(routers, timeout_s))
    interrupted = asyncio.ensure_future(stop_waiting.wait())
    await asyncio.wait([draining, interrupted], return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if draining.done():
        return draining.result()
    draining.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await draining
    print("tandem: a second signal: draining stopped", file=sys.stderr, flush=True)
    left = [router.num_in_flight.remote() for router in routers]  # type: ignore[attr-defined]
    return sum(await asyncio.gather(*left))


def stop_serve(timeout_s: float = 60.0) -> None:
    """Shuts Serve down as ``serve.shutdown()`` does (its controller deletes the apps, stops
    the proxies, then kills itself), but asks with a call Ray does not retry. Ray retries the
    controller's calls for ever, so ``serve.shutdown()``'s call, which waits until the
    controller is gone and so fails with it, is reported as "Task ServeController.
    graceful_shutdown failed ... will be retried" although nothing went wrong."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # Serve was not started
        return
    try:
        ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote(),
                timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # the controller is gone: Serve is shut down
    except ray.exceptions.GetTimeoutError:
        print(f"tandem: Serve did not shut down within {timeout_s:.0f} s", file=sys.stderr,
              flush=True)
