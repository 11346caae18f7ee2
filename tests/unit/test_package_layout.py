"""The product's packages as a reader finds them: no import circles, trainer_agent's rooms
each layered by a contract and documented in a line, and its public import paths."""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("weightsync", "coordinator", "trainer_agent", "rollout_agent")


def _circles(graph: object, modules: set[str]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt) & modules))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_of_the_product_imports_itself_through_others() -> None:
    """No import circle among the product's modules, function-level imports included
    (import-linter's acyclic_siblings contract sees packages; this sees each module)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph(*PRODUCT)
    assert _circles(graph, set(graph.modules)) == []


def test_the_circle_check_finds_a_circle() -> None:
    class Graph:
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m: str) -> set[str]:
            return self.edges.get(m, set())

    assert _circles(Graph(), {"a", "b", "c", "d"}) == [["a", "b", "c"]]


def _subpackages(package: str) -> list[Path]:
    return sorted(p.parent for p in (ROOT / package).glob("*/__init__.py"))


def test_trainer_agent_keeps_its_modules_in_rooms() -> None:
    top = sorted(p.stem for p in (ROOT / "trainer_agent").glob("*.py"))
    assert len(top) <= 10, top
    rooms = {p.name for p in _subpackages("trainer_agent")}
    assert {"publish", "device", "stage", "serve", "vllm", "convert"} <= rooms


@pytest.mark.parametrize("package", ["trainer_agent", "rollout_agent"])
def test_every_room_says_what_it_holds_in_a_line(package: str) -> None:
    for room in _subpackages(package):
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert doc and "\n" not in doc.strip(), f"{room.relative_to(ROOT)}/__init__.py: a one-line docstring"


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


@pytest.mark.parametrize("package", ["trainer_agent", "rollout_agent"])
def test_every_room_and_module_has_a_layer(package: str) -> None:
    """The component's layers contract names each of its packages and top-level modules
    (a new room is layered when it is made, not left out of the contract)."""
    (contract,) = [c for c in _contracts() if c["type"] == "layers" and c.get("containers") == [package]]
    layered = {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}
    children = {p.name for p in _subpackages(package)} | {
        p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"
    }
    assert children - layered == set()


def test_each_trainer_room_is_layered_inside() -> None:
    containers = {c["containers"][0] for c in _contracts() if c["type"] == "layers" and c.get("containers")}
    for room in ("publish", "device", "stage", "serve"):
        assert f"trainer_agent.{room}" in containers, room
        modules = {p.stem for p in (ROOT / "trainer_agent" / room).glob("*.py") if p.stem != "__init__"}
        (contract,) = [c for c in _contracts() if c.get("containers") == [f"trainer_agent.{room}"]]
        layered = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
        assert modules - layered == set(), room


def test_the_public_import_paths_stay() -> None:
    import trainer_agent
    from trainer_agent import PublisherSettings, PublishFuture, PublishResult, PublishSuperseded, WeightPublisher
    from trainer_agent.publish.async_publish import PublishFuture as Future
    from trainer_agent.publish.publisher import PublishResult as Result
    from trainer_agent.publish.publisher import WeightPublisher as Publisher

    assert WeightPublisher is Publisher and PublishResult is Result and PublishFuture is Future
    assert PublishSuperseded.__module__ == "trainer_agent.publish.async_publish"
    assert PublisherSettings.__module__ == "trainer_agent.settings"
    assert trainer_agent.TrainerConfig.__module__ == "trainer_agent.config"


def test_the_vllm_trainer_path_is_the_engine_module_itself() -> None:
    """`trainer_agent.vllm_trainer` (the README's import) is `trainer_agent.vllm.engine`:
    one module, so vLLM's factory gets the backend once and a patch reaches it."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    import trainer_agent
    import trainer_agent.vllm_trainer as public
    from trainer_agent import vllm_trainer
    from trainer_agent.vllm import engine
    from trainer_agent.vllm_trainer import WeightsyncTrainerEngine, WeightsyncTrainerInitInfo

    assert public is vllm_trainer is engine
    assert WeightsyncTrainerEngine is engine.WeightsyncTrainerEngine is trainer_agent.WeightsyncTrainerEngine
    assert WeightsyncTrainerInitInfo.__module__ == "trainer_agent.vllm.engine"
