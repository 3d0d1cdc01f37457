"""The package's shape: no import cycles, and the gateway process never needs MLX. And the tests' own: every
module that starts a fleet is marked as a fleet module, which `make test` runs on one worker (tests/conftest.py)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cluster"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> cluster modules it imports, anywhere in its body (function-level imports count)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            graph[mod] |= {t for t in targets if t in modules and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    def pkg(m):
        parts = m.split(".")
        return ".".join(parts[:2])

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(pkg(m), set()).update(pkg(d) for d in deps if pkg(d) != pkg(m))
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_no_two_subpackages_import_each_other():
    assert cycles(package_graph(import_graph())) == []


def test_negative_control_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


GATEWAY_SIDE = """
import sys
from pathlib import Path
import cluster.actors.gateway
from cluster.actors.served_model import ServedModel
from cluster.config import ModelSpec
served = ServedModel(ModelSpec(name="m", source="tiny-hybrid"), Path(sys.argv[1]), handle=None)
assert served.vocab_size > 0 and served.max_token_bytes > 1
print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))
"""


def test_the_gateway_needs_no_mlx(tmp_path):
    """Importing it and loading a model's tokenizer (for a model not built yet: no weights are made)."""
    out = subprocess.run([sys.executable, "-c", GATEWAY_SIDE, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "models" / "tiny-hybrid").exists()  # only its tokenizer was built


def test_importing_the_actors_changes_nothing_in_ray():
    code = ("import ray.serve._private.replica as r; before = r.add_port_to_grpc_server; "
            "import cluster.actors, cluster.actors.app; print(r.add_port_to_grpc_server is before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


STARTS_A_FLEET = ("LocalFleet(", '"up", "-y"')  # a local fleet, or a real `ray up`


def test_every_module_that_starts_a_fleet_is_a_fleet_module():
    """conftest's scheduler finds fleet modules by their `pytestmark`: one left unmarked would start its fleet
    beside another one, on the other worker."""
    from tests.conftest import FLEET_MARK, is_fleet_module

    starting = [p for p in (ROOT / "tests").rglob("test_*.py")
                if p != Path(__file__) and any(x in p.read_text() for x in STARTS_A_FLEET)]
    assert starting and [str(p.relative_to(ROOT)) for p in starting if not is_fleet_module(p)] == []
    # the pattern sees the mark however the module writes it
    assert FLEET_MARK.search("pytestmark = [pytest.mark.fleet, pytest.mark.timeout(600)]")
    assert not FLEET_MARK.search("pytestmark = pytest.mark.fleetish") and not FLEET_MARK.search("# pytest.mark.fleet")
