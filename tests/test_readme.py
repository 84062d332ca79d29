"""The README and the user's guide in docs/ say what the code has.

Every option of EngineConfig with its default and meaning, every variable of
cluster/environment.py (docs/configuration.md, and any other page's table of them), the keys of
speculative_config and of autoscaling, the fields of SamplingParams and the model catalog, each
where its page lists it. The README stays a first page (at most 250 lines), and every relative
link of the README and docs/ leads to a file that exists (and to a heading of it, where the link
names one).
"""

import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from cluster.engine.config import describe_options
from cluster.environment import VARIABLES
from router.autoscale import AutoscalingPolicy
from router.sampling_params import SamplingParams
from workers.catalog.entries import CATALOG, DEFAULT_MODEL
from workers.speculative.config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 250

OPTION_ROWS = {name: f"| `{name}` | {default} | {meaning} |"
               for name, default, meaning in describe_options()}
VARIABLE_ROWS = {v.name: f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARIABLES}


def page(name: str) -> str:
    return (DOCS / name).read_text()


def table_after(text: str, marker: str) -> list[str]:
    """The rows (header and rule left out) of the first table after marker in text."""
    lines = text[text.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows[2:]


def tables_with_header(text: str, header: str) -> list[list[str]]:
    """The rows of every table in text whose header line is header."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line == header and (i == 0 or not lines[i - 1].startswith("|")):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            found.append(rows)
    return found


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split(" | ")]


def shown(value: object) -> str:
    """A dataclass default as the guide writes it."""
    return "none" if value is None else str(value)


def defaults(cls: type) -> dict[str, str]:
    out = {}
    for f in fields(cls):
        value = f.default if f.default is not MISSING else f.default_factory()
        out[f.name] = shown(value)
    return out


def test_the_configuration_table_lists_every_option_its_default_and_meaning():
    expected = list(OPTION_ROWS.values())
    rows = table_after(page("configuration.md"),
                       "`LLM(model, **options)` and `EngineConfig(...)` take")
    assert rows == expected


def test_the_environment_table_lists_every_variable_tandem_reads():
    expected = list(VARIABLE_ROWS.values())
    rows = table_after(page("configuration.md"),
                       "Environment variables, read only where tandem starts")
    assert rows == expected


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_other_table_of_options_or_variables_says_what_the_code_has(path):
    text = path.read_text()
    for header, known in (("| option | default | meaning |", OPTION_ROWS),
                          ("| variable | default | meaning |", VARIABLE_ROWS)):
        for rows in tables_with_header(text, header):
            for row in rows:
                name = cells(row)[0].strip("`")
                assert name in known, f"{path.name}: {name} is not in the code"
                assert row == known[name]


def test_the_speculative_config_table_lists_every_key_and_its_default():
    rows = table_after(page("speculative-decoding.md"), "(`workers/speculative/config.py`):")
    assert [(cells(r)[0].strip("`"), cells(r)[1]) for r in rows] == list(
        defaults(SpeculativeConfig).items())


def test_the_autoscaling_table_lists_every_key_and_its_default():
    rows = table_after(page("replicas.md"), "--autoscaling-config")
    listed = {}
    for row in rows:
        names, values = cells(row)[:2]
        for name, value in zip(names.split(", "), values.split(", "), strict=True):
            listed[name.strip("`")] = value
    code = defaults(AutoscalingPolicy)
    assert list(listed) == list(code)
    for name, value in code.items():
        assert listed[name] == value or float(listed[name]) == float(value), name


def test_the_sampling_table_lists_every_field_and_its_default():
    rows = table_after(page("sampling.md"), "| field | default | meaning |")
    assert [(cells(r)[0].strip("`"), cells(r)[1]) for r in rows] == list(
        defaults(SamplingParams).items())


def test_the_catalog_table_lists_every_model():
    rows = table_after(page("models.md"), "## The catalog")
    expected = [[f"`{e.name}`" + (" (default)" if e.name == DEFAULT_MODEL else ""),
                 f"`{e.architecture}`", e.num_params, e.quantization] for e in CATALOG.values()]
    assert [cells(r) for r in rows] == expected


def test_the_readme_is_a_first_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to
    hyphens, -1, -2 ... after a repeat."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_that_exists(path):
    text = path.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        heading_missing = (linked.exists() and anchor and linked.suffix == ".md"
                           and anchor not in anchors(linked.read_text()))
        if not linked.exists() or heading_missing:
            broken.append(target)
    assert not broken, f"{path.name}: {broken}"
