"""`tandem serve`'s autoscaling flags: the bounds as flags of their own, the rest as JSON.

    tandem serve --min-replicas 1 --max-replicas 4 \\
        --autoscaling-config '{"target_running_seqs": 32, "downscale_delay_s": 300}'

Any of them turns engine autoscaling on; the keys are the Serve config's ``autoscaling`` keys
(router/autoscale.py's ``AutoscalingPolicy``), checked with the rest of the configuration.
"""

import argparse
import json

BOUNDS = {"min_replicas": "--min-replicas", "max_replicas": "--max-replicas"}


def add_autoscaling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-replicas", type=int, help="autoscale engine replicas: at least "
                        "this many (turns autoscaling on; --replicas is then the start)")
    parser.add_argument("--max-replicas", type=int, help="autoscale engine replicas: at most "
                        "this many (turns autoscaling on)")
    parser.add_argument("--autoscaling-config", help="the other autoscaling keys as JSON, e.g. "
                        "'{\"target_running_seqs\": 32, \"upscale_delay_s\": 30, "
                        "\"downscale_delay_s\": 600}'")


def autoscaling_config(args: argparse.Namespace) -> dict | None:
    """The ``autoscaling`` section the flags ask for; None when none was given."""
    config: dict = {}
    if args.autoscaling_config is not None:
        try:
            config = json.loads(args.autoscaling_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--autoscaling-config: not JSON ({error.msg})") from None
        if not isinstance(config, dict):
            raise ValueError("--autoscaling-config: give a JSON object")
    for key, flag in BOUNDS.items():
        value = getattr(args, key)
        if value is None:
            continue
        if key in config and config[key] != value:
            raise ValueError(f"{flag} {value} contradicts --autoscaling-config's {key!r}")
        config[key] = value
    return config or None
