"""The operator's layout is its architecture (docs/architecture.md): each stage is a folder of
specpair_operator, and a stage imports only the stages below it, with no circle among modules.
The drafters are a package of small modules, and nothing outside it asks which drafter it has.

Stages, bottom up: crd (the contract), release (what a release and the registry are), clients (the
thin I/O adapters), desired (the objects wanted, and ownership as values), policy (the judgments),
gate (the gate Job and its verdict), state.py (the process's clients and caches), observe (reads
into values), plan (pure decisions), act (the one writer); the root (handlers, leadership,
__main__) wires them to Kopf. Imports made for the type checker only (`if TYPE_CHECKING:`) are
not arrows: nothing runs them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from import_graph import circles, module_name   # tests/ is on sys.path

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "specpair_operator"
DRAFTERS = REPO / "engine" / "specpair" / "drafters"
STAGES = ["crd", "release", "clients", "desired", "policy", "gate", "state", "observe", "plan", "act", "(root)"]
# Arrows still running up, each a refactor not done yet (issue 55); a new one fails the test.
# None left: observe asks the serving plan's questions through observe/serving_questions.py,
# handed in by act (test_the_serving_plan_answers_every_question_observe_asks); a new one fails.
KNOWN_UPWARD: set[str] = set()
# No circle is left (the autoscaling signal table, which the spec's check reads, is the contract's:
# crd/autoscaling_signals.py); a new one fails.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
# Modules over the size, to be split: none left (the release plan and the manifests were split by
# concern as the serving plan was); a new one fails.
KNOWN_LONG: set[str] = set()
OPERATOR_MODULE_LINES = 600
DRAFTER_MODULE_LINES = 400


def operator_imports() -> dict[str, set[str]]:
    """Module -> the operator's modules it imports (at module level or in a function)."""
    files = {module_name(p, OPERATOR.parent): p for p in OPERATOR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "specpair_operator":
                    edges.add(target)
        graph[name] = edges
    return graph


def stage(module: str) -> str:
    """A module's stage: its folder; state.py (the process's clients and caches) sits above the
    clients it holds; the rest of the root is the wiring, above everything."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES):
        return parts[1]
    return "(root)"


def upward_arrows() -> set[str]:
    return {f"{m} -> {t}" for m, targets in operator_imports().items() for t in targets
            if STAGES.index(stage(t)) > STAGES.index(stage(m))}


def test_every_module_lives_in_a_stage_or_is_the_wiring():
    stray = sorted(m for m in operator_imports() if stage(m) not in STAGES)
    assert not stray, f"modules outside the stages {STAGES}: {stray}"
    roots = sorted(m for m in operator_imports() if stage(m) == "(root)")
    assert roots == ["specpair_operator", "specpair_operator.__main__", "specpair_operator.handlers",
                     "specpair_operator.leadership"], roots


def test_the_graph_sees_function_level_and_relative_imports():
    graph = operator_imports()
    assert "specpair_operator.leadership" in graph["specpair_operator.__main__"]     # inside a function
    assert "specpair_operator.clients.kube" in graph["specpair_operator.act.owned"]
    # a type-only import is no arrow: carry_out names the reconciler for the type checker alone
    assert "specpair_operator.act.reconciler" not in graph["specpair_operator.act.carry_out"]
    assert "specpair_operator.act.carry_out" in graph["specpair_operator.act.reconciler"]


def test_no_operator_module_imports_one_that_imports_it_back():
    found = [c for c in circles(operator_imports()) if tuple(c[:-1]) not in KNOWN_CIRCLES]
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_each_stage_imports_only_the_stages_below_it():
    upward = upward_arrows()
    assert not upward - KNOWN_UPWARD, "imports running up the stages:\n" + "\n".join(sorted(upward - KNOWN_UPWARD))
    assert not KNOWN_UPWARD - upward, f"gone, strike them from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"


def test_the_serving_plan_answers_every_question_observe_asks():
    """observe/reads.py asks its questions of what act hands in (plan/serving_plan.py, a module):
    each member of the protocol is there, a function with the protocol's parameters."""
    import inspect

    from specpair_operator.observe.serving_questions import ServingQuestions
    from specpair_operator.plan import serving_plan

    members = [m for m in ServingQuestions.__dict__ if not m.startswith("_")] + \
        list(ServingQuestions.__annotations__)
    assert {"rollout_state", "identity", "ANN_ISSUED_FOR"} <= set(members), members
    for name in members:
        assert hasattr(serving_plan, name), f"plan/serving_plan.py answers no {name}"
        asked = getattr(ServingQuestions, name, None)
        if callable(asked):
            wanted = list(inspect.signature(asked).parameters)[1:]            # without self
            assert list(inspect.signature(getattr(serving_plan, name)).parameters) == wanted, name


@pytest.mark.parametrize("root, limit", [(OPERATOR, OPERATOR_MODULE_LINES), (DRAFTERS, DRAFTER_MODULE_LINES)],
                         ids=["operator", "drafters"])
def test_no_module_is_over_its_size(root, limit):
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 5
    over = {p: n for p, n in sizes.items() if n > limit and p not in KNOWN_LONG}
    assert not over, f"over {limit} lines: {over}"


def step_type_names() -> set[str]:
    """The class names of the union act matches (plan/steps.py)."""
    import typing

    from specpair_operator.plan.steps import Step

    names, todo = set(), [Step]
    while todo:
        for arg in typing.get_args(todo.pop()):
            (todo.append(arg) if typing.get_args(arg) else names.add(arg.__name__))
    return names


def isinstance_tests(root: Path, names: set[str]) -> list[str]:
    """Each `isinstance(x, C)` under root where C (or one of a tuple) is one of `names`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                hit = {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", "") for k in kinds} & names
                if hit:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(hit)}")
    return found


def drafter_class_names() -> set[str]:
    """The proposers the drafters package defines (its classes named ...Drafter, the protocol too)."""
    return {node.name for path in DRAFTERS.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.name.endswith("Drafter")}


def test_nothing_outside_the_drafters_package_asks_which_drafter_it_has():
    """The engine, benchmarks, scripts and demo reach a drafter through its protocol's hooks
    (drafters/base.py: warm-up, cost probe, what its rows need), never by testing its class."""
    names = drafter_class_names()
    assert {"Drafter", "NgramDrafter", "ModelDrafter", "EagleDrafter", "MedusaDrafter"} <= names, names
    # The scan finds one where it may stand: tests check which drafter a pair loaded.
    assert isinstance_tests(REPO / "tests" / "engine", names), "the scan finds the tests' own (it would find any)"
    outside = [hit for root in ("engine", "bench", "scripts", "demo")
               for hit in isinstance_tests(REPO / root, names) if "/drafters/" not in hit.split(":")[0]]
    assert not outside, outside


def test_act_tests_no_step_type_it_does_not_match():
    """Act carries a step out by the one match (act/carry_out.py), never by isinstance; a plan
    may look back at the steps it emitted itself (its own accumulator), nothing else may."""
    names = step_type_names()
    assert {"SetAlias", "EnsureOwned", "Report", "ScaleDown"} <= names
    tests = isinstance_tests(OPERATOR, names)
    assert tests, "the scan finds the plans' own look-backs (it would find any)"
    outside_plans = [t for t in tests if not t.startswith("operator/specpair_operator/plan/")]
    assert not outside_plans, outside_plans
