"""The drafters are a package, one proposer a module (engine/specpair/drafters/), and the engine
asks a drafter what it needs through the protocol's hooks (base.Drafter: draft_model,
step_model, cached_model, reusable_prefix_cache, priced_as, warm_up_steps, cost_probe), never
which class it is: no isinstance on a drafter class outside the package. Each module stays
under 400 lines (tests/operator/test_operator_layout.py holds the sizes)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import specpair.drafters as drafters
from specpair.drafters import Drafter

ENGINE = Path(__file__).resolve().parents[2] / "engine" / "specpair"
PACKAGE = ENGINE / "drafters"


def drafter_classes() -> set[str]:
    """Every Drafter subclass the package defines, EAGLE-3's (imported where chosen) included."""
    import specpair.drafters.eagle3  # noqa: F401

    found, todo = set(), [Drafter]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("specpair.drafters."):
                found.add(sub.__name__)
                todo.append(sub)
    return found | {"Drafter"}


def test_every_exported_drafter_is_found_by_the_scan():
    names = drafter_classes()
    exported = {n for n, v in vars(drafters).items() if inspect.isclass(v) and issubclass(v, Drafter)}
    assert exported <= names
    assert {"NgramDrafter", "ModelDrafter", "EagleDrafter", "MedusaDrafter", "LookupFirstDrafter",
            "Eagle3Drafter", "HeadDrafter"} <= names


def test_no_isinstance_on_a_drafter_class_outside_the_package():
    names = drafter_classes()
    found, scanned = [], 0
    for path in sorted(ENGINE.rglob("*.py")):
        if PACKAGE in path.parents:
            continue
        scanned += 1
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                hit = {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", "") for k in kinds} & names
                if hit:
                    found.append(f"{path.relative_to(ENGINE)}:{node.lineno} {sorted(hit)}")
    assert scanned > 50
    assert not found, "ask the drafter (base.Drafter's hooks) instead: " + "; ".join(found)


def test_each_drafter_says_what_the_engine_needs_of_it():
    """The hooks' answers per kind, as the engine used to derive them from the class."""
    from specpair.drafters import EagleDrafter, LookupFirstDrafter, MedusaDrafter, ModelDrafter, NgramDrafter

    assert ModelDrafter.draft_per_token and EagleDrafter.draft_per_token
    assert not NgramDrafter.draft_per_token and not MedusaDrafter.draft_per_token
    ngram = NgramDrafter()
    assert (ngram.draft_model(), ngram.step_model(), ngram.cached_model(), ngram.reusable_prefix_cache(),
            ngram.warm_up_steps(2, 64, 1, 4)) == (None, None, None, None, None)
    assert ngram.priced_as() is ngram and not ngram.copies
    assert LookupFirstDrafter.copies
    for hook in ("priced_as", "cached_model", "warm_up_steps"):
        assert hook in vars(LookupFirstDrafter), f"lookup-first answers {hook} with its head's"
