"""A run's record: the environment, a markdown table on stdout, and a JSON file."""

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path("bench-results")


def machine_facts(device: torch.device) -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "device": str(device)}
    for package in ("triton", "transformers"):
        try:
            env[package] = __import__(package).__version__
        except ImportError:
            env[package] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory,
                "gpu_sms": props.multi_processor_count, "cuda": torch.version.cuda}
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["torch_threads"] = torch.get_num_threads()
    return env


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return "—" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(record: dict, output: str | None, workload: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(output) if output else RESULTS_DIR / f"{workload}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def publish(record: dict, table: str, output: str | None) -> Path:
    record["table"] = table
    path = write_json(record, output, record["workload"])
    print("\n" + table + "\n")
    print(f"wrote {path}")
    return path
