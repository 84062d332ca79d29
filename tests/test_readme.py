"""The README's configuration and environment tables say what the code has: every option of
EngineConfig with its default and meaning, every variable of cluster/environment.py."""

from pathlib import Path

from cluster.engine.config import describe_options
from cluster.environment import VARIABLES

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def table_after(heading_text: str) -> list[str]:
    """The rows (header and rule left out) of the first table after heading_text."""
    lines = README[README.index(heading_text):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]


def test_the_configuration_table_lists_every_option_its_default_and_meaning():
    expected = [f"| `{name}` | {default} | {meaning} |"
                for name, default, meaning in describe_options()]
    assert table_after("`LLM(model, **options)` and `EngineConfig(...)` take") == expected


def test_the_environment_table_lists_every_variable_tandem_reads():
    expected = [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARIABLES]
    assert table_after("Environment variables, read only where tandem starts") == expected
