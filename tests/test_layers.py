"""The house rules of the import graph, read from the source with `ast` (nothing is imported).

Every import counts, at module level, inside a function (lazy) or under `TYPE_CHECKING`: a lazy or
type-only arrow is still an arrow. The rules:
- `rollout/**` never imports ray or vllm at module level (inside functions and `TYPE_CHECKING`: fine);
- scheduling and hand-out never import serving, weights, benchmarks or the learner helpers;
- only `rollout/engine.py` imports `actors` (among `rollout/` and `policies/`);
- `policies/**` imports only the foundation of `rollout` (its leaf modules: types, config, ...);
- in `rollout/`, only `rollout/engine.py` (which starts the engines) and `rollout/weights/trainer.py`
  (the learner's public half of weight transfer) import `policies`: one door each way;
- in `rollout/`, only `rollout/weights/trainer.py` (the learner's public half of weight transfer)
  names vLLM's weight-transfer classes or ours;
- the data path's protocol (every name `rollout/wire.py` defines) is imported from `rollout.wire`,
  never from `policies/` (tests included);
- no module imports another module's private (`_name`) name;
- no circles between the parts of `rollout/` (a subpackage, or a module at its top, is one part),
  nor between its modules (type-only imports included);
- no test module imports another test module: test helpers live in `tests/support/`;
- `WeightTransfer` uses only what the `Updates` protocol declares of the engine's weight updates.
Each failure names the file, line and import that breaks the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("rollout", "actors", "policies", "benchmarks")
FOUNDATION = {
    f"rollout.{m}"
    for m in ("aio", "batch", "config", "driver_process", "epochs", "errors", "log", "packed", "parsers", "tensors",
              "tiny", "torch_addons", "transfer_backend", "types", "wire")
}  # fmt: skip
LOWER = ("rollout.scheduling", "rollout.handout")
ABOVE_THEM = ("rollout.serve", "rollout.weights", "rollout.bench.run", "rollout.learner", "benchmarks")


class Import(NamedTuple):
    path: str  # the importing file, relative to the repository
    line: int
    module: str  # the imported module, absolute
    names: tuple[str, ...]  # `from module import names`; () for `import module`
    top_level: bool  # run at import time (not in a function, not under TYPE_CHECKING)

    def __str__(self) -> str:
        what = f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"
        return f"{self.path}:{self.line}: {what}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, source: str | None = None) -> Iterator[Import]:
    """Every import in the file at `path` (or in `source`, as if it were that file)."""
    rel, me = str(path.relative_to(ROOT)), module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]

    def walk(node: ast.AST, top: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, False)
            elif isinstance(child, ast.Import):
                yield from (Import(rel, child.lineno, a.name, (), top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                module = ".".join([*base, child.module] if child.module else base)
                for a in child.names:  # `from rollout import scheduling` imports the module rollout.scheduling
                    sub = f"{module}.{a.name}"
                    if (
                        module.startswith(PROJECT)
                        and (ROOT / sub.replace(".", "/")).with_suffix(".py").exists()
                        or (ROOT / sub.replace(".", "/")).is_dir()
                    ):
                        yield Import(rel, child.lineno, sub, (), top)
                    else:
                        yield Import(rel, child.lineno, module, (a.name,), top)
            else:
                yield from walk(child, top)

    yield from walk(ast.parse(path.read_text() if source is None else source, rel), True)


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


ALL = {folder: [i for f in files(folder) for i in imports(f)] for folder in PROJECT}


def broken(found: list[Import]) -> str:
    return "\n".join(map(str, found))


# The learner's half of weight transfer: vLLM's classes and ours, named in `rollout/` by one module.
TRANSFER = ("vllm.distributed.weight_transfer", "policies.gloo_transfer", "policies.gloo_wire",
            "policies.shm_transfer", "policies.shm_wire", "policies.shm_trainer", "policies.transfer_join")  # fmt: skip
LEARNER_SIDE = "rollout/weights/trainer.py"


def test_only_the_public_learner_module_names_the_weight_transfer_classes_in_rollout():
    found = [i for i in ALL["rollout"] if under(i.module, *TRANSFER) and i.path != LEARNER_SIDE]
    assert not found, broken(found)


def test_rollout_never_imports_ray_or_vllm_at_module_level():
    found = [i for i in ALL["rollout"] if i.top_level and under(i.module, "ray", "vllm")]
    assert not found, broken(found)


def test_scheduling_and_hand_out_never_import_serving_weights_benchmarks_or_the_learner():
    found = [i for i in ALL["rollout"] if under(module_name(ROOT / i.path), *LOWER) and under(i.module, *ABOVE_THEM)]
    assert not found, broken(found)


def test_only_the_engine_imports_actors():
    found = [
        i
        for folder in ("rollout", "policies")
        for i in ALL[folder]
        if under(i.module, "actors") and i.path != "rollout/engine.py"
    ]
    assert not found, broken(found)


DOORS = ("rollout/engine.py", LEARNER_SIDE)  # the modules of rollout/ that reach the engine side


def test_rollout_reaches_policies_only_through_the_engine_and_the_learner_module():
    found = [i for i in ALL["rollout"] if under(i.module, "policies") and i.path not in DOORS]
    assert not found, broken(found)


def test_policies_import_only_the_foundation_of_rollout():
    found = [i for i in ALL["policies"] if under(i.module, "rollout") and i.module not in FOUNDATION]
    assert not found, broken(found)


def defined(path: Path) -> set[str]:
    """The names a module binds at its top: its classes, functions and assigned names."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


WIRE = defined(ROOT / "rollout" / "wire.py")


def test_the_wire_protocol_is_imported_from_rollout_wire_never_from_policies():
    found = [
        i
        for i in [*(i for f in PROJECT for i in ALL[f]), *TESTS]
        if under(i.module, "policies") and WIRE.intersection(i.names)
    ]
    assert not found, broken(found)


def test_no_module_imports_another_modules_private_name():
    found = [
        i
        for f in PROJECT
        for i in ALL[f]
        if under(i.module, *PROJECT) and any(n.startswith("_") and not n.startswith("__") for n in i.names)
    ]
    assert not found, broken(found)


def part(module: str) -> str:
    """The part of rollout/ a module belongs to: its subpackage, or itself at the top."""
    return ".".join(module.split(".")[:2])


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_parts_of_rollout_import_each_other_without_circles():
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], Import] = {}
    for i in ALL["rollout"]:
        a, b = part(module_name(ROOT / i.path)), part(i.module)
        if (
            under(i.module, "rollout") and a != b and a != "rollout" and b != "rollout"
        ):  # `rollout` is the face: imports all
            edges.setdefault(a, set()).add(b)
            why.setdefault((a, b), i)
    found = cycle(edges)
    assert found is None, (
        "a circle: " + " -> ".join(found) + "\n" + broken([why[a, b] for a, b in zip(found, found[1:])])
    )


def circles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The graph's circles: each set of nodes that reach one another (a strongly connected
    component of more than one node), sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_modules_of_rollout_import_each_other_without_circles():
    """Every import counts (lazy and type-only too): a module that names another's type for its
    annotations depends on it as much as one that calls it."""
    modules = {module_name(f) for f in files("rollout")}
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], Import] = {}
    for i in ALL["rollout"]:
        a = module_name(ROOT / i.path)
        if i.module in modules and i.module != a and "rollout" not in (a, i.module):  # the face imports all
            edges.setdefault(a, set()).add(i.module)
            why.setdefault((a, i.module), i)
    found = circles(edges)
    assert not found, "\n".join(
        "a circle: " + ", ".join(c) + "\n" + broken([i for (a, b), i in why.items() if a in c and b in c])
        for c in found
    )


@pytest.mark.parametrize(
    "source, rule",
    [
        ("import ray\n", test_rollout_never_imports_ray_or_vllm_at_module_level),
        (
            "from rollout.serve.server import Server\n",
            test_scheduling_and_hand_out_never_import_serving_weights_benchmarks_or_the_learner,
        ),
        ("def f():\n    from actors.pool import RayEnginePool\n", test_only_the_engine_imports_actors),
        ("from rollout.engine import _private\n", test_no_module_imports_another_modules_private_name),
        (
            "from policies.group_calls import RESULTS, GroupCalls\n",
            test_the_wire_protocol_is_imported_from_rollout_wire_never_from_policies,
        ),
        (
            "def f():\n    from policies.gloo_transfer import StateDictSource\n",
            test_only_the_public_learner_module_names_the_weight_transfer_classes_in_rollout,
        ),
        (
            "def f():\n    from policies.vllm_args import checked_engine_args\n",
            test_rollout_reaches_policies_only_through_the_engine_and_the_learner_module,
        ),
    ],
)
def test_each_rule_fails_on_a_planted_violation(source, rule, monkeypatch):
    """The rules can fail: one import planted in a scheduling module breaks each."""
    planted = ROOT / "rollout" / "scheduling" / "planted_for_test.py"
    monkeypatch.setitem(ALL, "rollout", [*ALL["rollout"], *imports(planted, source)])
    with pytest.raises(AssertionError, match="planted_for_test.py:"):
        rule()


TESTS = [i for f in files("tests") for i in imports(f)]


def test_no_test_module_imports_another():
    found = [i for i in TESTS if i.module.rpartition(".")[2].startswith(("test_", "conftest"))]
    assert not found, broken(found)


def test_a_planted_import_of_a_test_module_is_found(monkeypatch):
    planted = ROOT / "tests" / "integration" / "test_planted.py"
    monkeypatch.setitem(globals(), "TESTS", [*TESTS, *imports(planted, "from .test_weights import x\n")])
    with pytest.raises(AssertionError, match="test_planted.py:1: from tests.integration.test_weights import x"):
        test_no_test_module_imports_another()


def test_a_planted_type_only_circle_between_modules_is_found(monkeypatch):
    assert circles({"a": {"b"}, "b": {"c", "a"}, "c": set(), "d": {"e"}, "e": {"d"}}) == [("a", "b"), ("d", "e")]
    planted = ROOT / "rollout" / "scheduling" / "callback_group.py"  # callback_group -> scheduler -> callback_group
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollout.scheduling.scheduler import Scheduler\n"
    )
    monkeypatch.setitem(ALL, "rollout", [*ALL["rollout"], *imports(planted, source)])
    with pytest.raises(AssertionError, match="rollout.scheduling.callback_group, rollout.scheduling.scheduler"):
        test_the_modules_of_rollout_import_each_other_without_circles()


def test_a_planted_circle_is_found(monkeypatch):
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}}) is None
    planted = ROOT / "rollout" / "handout" / "planted_for_test.py"  # hand-out -> scheduling -> hand-out
    monkeypatch.setitem(
        ALL, "rollout", [*ALL["rollout"], *imports(planted, "from rollout.scheduling.scheduler import Scheduler\n")]
    )
    with pytest.raises(AssertionError, match="a circle: .*rollout.handout"):
        test_the_parts_of_rollout_import_each_other_without_circles()


def test_the_public_learner_module_hands_out_the_engine_sides_own_classes():
    """`rollout.weights.trainer` re-exports, it does not copy: each name is the class the engines'
    workers and vLLM's factories know, imported on first use."""
    import importlib

    trainer = importlib.import_module("rollout.weights.trainer")
    for name in trainer.__all__:
        home = importlib.import_module(trainer._HOME[name])
        assert getattr(trainer, name) is getattr(home, name), name
    assert sorted(trainer._HOME) == trainer.__all__
    with pytest.raises(AttributeError, match="no attribute 'GlooWeightTransferEngine'"):
        trainer.GlooWeightTransferEngine  # noqa: B018  (the engine's half is not the learner's)


def test_the_weight_transfer_reaches_the_updates_only_through_their_protocol():
    """`WeightTransfer` uses of `WeightUpdates` (its `self.u`) only what `rollout.weights.round.Updates`
    declares: a new reach into the update side's state fails here, naming it."""
    body = next(
        n for n in ast.parse((ROOT / "rollout/weights/round.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "Updates"
    )  # fmt: skip
    declared = {n.name for n in body.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    declared |= {n.target.id for n in body.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    tree = ast.parse((ROOT / "rollout/weights/transfer.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self.u"}
    assert used and used <= declared, sorted(used - declared)
