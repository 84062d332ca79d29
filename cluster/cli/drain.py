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


def drain_and_stop(timeout_s: float, app_name: str, engines_deployment: str) -> None:
    """Drains the app's cluster, then shuts Serve down. In one event loop: throughput-optimized
    Serve runs a handle's router on the caller's loop, and shutting Serve down shuts the
    handle's router down too, which needs that loop still open."""
    asyncio.run(_drain_and_stop(timeout_s, app_name, engines_deployment))


async def _drain_and_stop(timeout_s: float, app_name: str, engines_deployment: str) -> None:
    from ray import serve

    second_signal = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, second_signal.set)
    started = time.monotonic()
    left = await _drain(timeout_s, app_name, engines_deployment, second_signal)
    took = time.monotonic() - started
    if left:
        print(f"tandem: {left} request(s) still running after {took:.1f} s of draining are cut "
              "off", file=sys.stderr, flush=True)
    else:
        print(f"tandem: drained in {took:.1f} s", flush=True)
    print("tandem: shutting down", flush=True)
    await serve.shutdown_async()


async def _drain(timeout_s: float, app_name: str, engines_deployment: str,
                 stop_waiting: asyncio.Event) -> int:
    """How many requests were still running when the drain ended."""
    from ray import serve

    from cluster.ray.tandem_cluster import TandemCluster

    try:
        engines = serve.get_deployment_handle(engines_deployment, app_name=app_name)
        handles = await asyncio.wait_for(engines.handles.remote(), 10)
    except Exception as error:  # stopped while loading: no engines to drain yet
        print(f"tandem: nothing to drain ({type(error).__name__})", flush=True)
        return 0
    print(f"tandem: draining (new requests get 503; up to {timeout_s:.0f} s for those in "
          "flight)", flush=True)
    cluster = TandemCluster.attach(handles)
    draining = asyncio.ensure_future(cluster.drain(timeout_s))
    interrupted = asyncio.ensure_future(stop_waiting.wait())
    await asyncio.wait([draining, interrupted], return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if draining.done():
        return draining.result()
    draining.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await draining
    print("tandem: a second signal: draining stopped", file=sys.stderr, flush=True)
    return await cluster.router.num_in_flight.remote()  # type: ignore[attr-defined]
