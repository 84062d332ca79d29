"""The rooms' rules, read from the source: who may import whom, where the environment is read,
and that product packages hold product code only (no scripts, checks or shell drivers)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("kvstore", "router", "workers", "cluster")
OURS = (*PRODUCT, "tests", "tools")
# room -> the rooms (dotted prefixes) its modules may import
MAY_IMPORT = {
    "kvstore": ("kvstore",),
    "router": ("router", "kvstore"),
    "workers": ("workers", "kvstore"),
    "cluster.engine": ("cluster.engine", "cluster.environment", "router", "kvstore", "workers"),
    "cluster.ray": ("cluster.ray", "cluster.engine", "cluster.environment", "router", "kvstore",
                    "workers"),
    "cluster.serve": ("cluster.serve", "cluster.ray", "cluster.engine", "cluster.environment",
                      "router", "kvstore", "workers"),
    "cluster.bench": ("cluster",) + PRODUCT,
    "cluster.cli": ("cluster",) + PRODUCT,
    "cluster": PRODUCT,  # cluster/__init__.py and cluster/environment.py
}
# the imports against the arrows: the engine starts the Ray executor when tensor parallel
# (lazily, inside make_executor), so that LLM(..., tensor_parallel_size=2) works offline, and
# the draft actor for speculative_config placement "actor" (lazily, inside _draft_actor)
ALLOWED = {("cluster/engine/engine_setup.py", "cluster.ray.ray_executor"),
           ("cluster/engine/llm_engine.py", "cluster.ray.draft_actor"),
           ("cluster/engine/llm_engine.py", "cluster.ray.draft_actor.draft_actor")}
# the edges that may call cluster/environment.py (it alone touches os.environ); the shard
# and replica actors set their own process's variables as they start
ENVIRONMENT_CALLERS = ("cluster/cli/", "cluster/bench/", "cluster/engine/config.py",
                       "cluster/serve/config.py", "cluster/ray/shard_actor.py",
                       "cluster/ray/replica.py")
ENTRY_POINTS = ("cluster/cli/main.py", "cluster/bench/__main__.py")


def modules() -> list[Path]:
    return sorted(p for room in PRODUCT for p in (ROOT / room).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def room_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "cluster" and len(parts) > 2:
        return f"cluster.{parts[1]}"
    return parts[0]


def imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] in OURS]


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_each_module_imports_only_what_its_room_may(path):
    allowed = MAY_IMPORT[room_of(path)]
    wrong = sorted({name for name in imported(ast.parse(path.read_text()))
                    if not within(name, allowed)
                    and not any(rel(path) == f and within(name, (m,)) for f, m in ALLOWED)
                    # `from cluster import environment` names the package, then the module
                    and not (name == "cluster" and "cluster.environment" in allowed)})
    assert wrong == []


def touches_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in ("environ", "getenv", "putenv",
                                                            "unsetenv")):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv", "putenv") for alias in node.names):
            return True
    return False


def test_only_cluster_environment_reads_or_sets_the_environment():
    readers = [rel(p) for p in modules() if touches_environment(ast.parse(p.read_text()))]
    assert readers == ["cluster/environment.py"]


def test_only_the_edges_call_cluster_environment():
    callers = [rel(p) for p in modules()
               if "cluster.environment" in imported(ast.parse(p.read_text()))
               or "from cluster import environment" in p.read_text()]
    assert callers and all(c.startswith(ENVIRONMENT_CALLERS) for c in callers), callers


def test_product_packages_hold_no_scripts_checks_or_shell_drivers():
    scripts = [rel(p) for p in modules() if rel(p) not in ENTRY_POINTS
               and "__name__ == \"__main__\"" in p.read_text()]
    shell = [rel(p) for room in PRODUCT for p in (ROOT / room).rglob("*.sh")]
    named = [rel(p) for p in modules()
             if p.stem.startswith(("tune_", "check_", "bench_", "run_gpu")) or p.stem.endswith(
                 "_check")]
    assert (scripts, shell, named) == ([], [], [])


def test_every_tool_is_listed_with_its_purpose_and_command():
    readme = (ROOT / "tools" / "README.md").read_text()
    tools = sorted(rel(p) for p in (ROOT / "tools").rglob("*") if p.suffix in (".py", ".sh")
                   and p.name != "__init__.py")
    assert tools and [t for t in tools if f"`{t}`" not in readme] == []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of ours a module imports as it loads, or names for its type checker (under
    ``if TYPE_CHECKING:``): imports inside functions are left out, they run after both load."""
    names: set[str] = set()
    for node in tree.body:
        for stmt in node.body if isinstance(node, ast.If) else [node]:
            if isinstance(stmt, ast.Import):
                names |= {alias.name for alias in stmt.names}
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                # `from a.b import c` names the module a.b.c where there is one, else a.b
                for alias in stmt.names:
                    sub = f"{stmt.module}.{alias.name}"
                    names.add(sub if sub in known else stmt.module)
    return names & known


def test_no_module_imports_itself_round_a_circle():
    paths = modules()
    known = {module_name(p) for p in paths}
    graph = {module_name(p): top_level_imports(ast.parse(p.read_text()), known) - {module_name(p)}
             for p in paths}
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt > start:  # each circle once, from its least module
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert circles == []
