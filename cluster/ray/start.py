"""Starting a local Ray instance, again when its raylet dies in its first seconds.

Ray 2.60's raylet gives its dashboard agent a fixed 15 s to write its port file and exits when
the agent is late (ray-project/ray#65983): on a busy machine (two cores, a test suite or a
model loading beside it) ``ray.init()`` then fails with "The current node timed out during
startup", and the raylet's own log holds the reason. Nothing of the failed start lives on, so
starting again is safe, and a second slow start in a row is rare. Any other error is raised
at once.
"""

import logging

log = logging.getLogger(__name__)

STARTUP_TIMEOUT = "timed out during startup"  # Ray's words when its raylet died starting
ATTEMPTS = 3


def init_ray(**kwargs: object) -> None:
    """``ray.init(**kwargs)``, started again (up to ATTEMPTS in all) when the node timed out
    during startup."""
    import ray

    for attempt in range(1, ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as error:
            if STARTUP_TIMEOUT not in str(error) or attempt == ATTEMPTS:
                raise
            log.warning("Ray did not start (%s); starting it again (attempt %d of %d)",
                        error, attempt + 1, ATTEMPTS)
            ray.shutdown()
