"""The code keeps the shape docs/architecture.md draws: no import circles, layers, services apart, a pure core."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_rules import layer_of, violations

ROOT = Path(__file__).resolve().parent.parent


def test_the_project_keeps_its_import_rules():
    assert violations(ROOT) == []


def test_benchmarks_and_tests_helpers_are_checked_too(tmp_path):
    from tests.import_rules import modules

    checked = modules(ROOT)
    assert {"benchmarks.load", "benchmarks.hot_paths", "benchmarks.workload", "tests.harness"} <= set(checked)
    root = write(tmp_path, {  # the circle load.py <-> hot_paths.py had, and a service reaching into the tests
        "benchmarks/load.py": "def main():\n    from benchmarks.hot_paths import machine_speed\n",
        "benchmarks/hot_paths.py": "from benchmarks.load import MODEL\n",
        "services/store/db.py": "from tests.harness import ROOT\n",
        "tests/harness.py": "ROOT = 1\n",
    })
    found = violations(root)
    assert "circle: benchmarks.hot_paths <-> benchmarks.load" in found
    assert any(v.startswith("layer: services.store.db") and "tests.harness" in v for v in found), found


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {p.parent for p in root.rglob("*.py")}:
        (package / "__init__.py").touch()
    return root


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    root = write(tmp_path, {
        "services/store/a.py": "from services.store import b\n",
        "services/store/b.py": "def f():\n    from services.store.a import x\n",
    })
    assert violations(root) == ["circle: services.store.a <-> services.store.b"]


def test_a_circle_under_type_checking_is_found(tmp_path):
    root = write(tmp_path, {
        "services/executor/train/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from services.executor.train.b import B\n",
        "services/executor/train/b.py": "from . import a\n",
    })
    assert violations(root) == ["circle: services.executor.train.a <-> services.executor.train.b"]


def test_one_service_importing_another_is_refused(tmp_path):
    root = write(tmp_path, {
        "services/executor/workers.py": "from services.profiler.runner import STEADY\n",
        "services/profiler/runner.py": "STEADY = {}\n",
    })
    assert violations(root) == [
        "service: services.executor.workers imports services.profiler.runner: one service package never "
        "imports another"
    ]


def test_a_lower_layer_importing_a_higher_one_is_refused(tmp_path):
    root = write(tmp_path, {
        "services/zoo/build.py": "from services.store.validation import check\n",
        "services/store/validation.py": "def check(): ...\n",
        "ballast/client.py": "import ballast.cli.main\n",
        "ballast/cli/main.py": "",
    })
    assert violations(root) == [
        "layer: ballast.client (contracts and SDK) imports ballast.cli.main (CLI), a higher layer",
        "layer: services.zoo.build (zoo) imports services.store.validation (services), a higher layer",
    ]


def test_the_pure_core_imports_no_orchestration_and_no_io(tmp_path):
    root = write(tmp_path, {
        "services/planner/search/engine.py": "import grpc\nfrom services.planner.jobs.scheduler import S\n"
                                             "from services.planner.cost import model\n",
        "services/planner/cost/model.py": "from ballast.v1 import plan_pb2\n",
        "services/planner/jobs/scheduler.py": "from services.planner.search import engine\nS = 1\n",
    })
    assert violations(root) == [
        "circle: services.planner.jobs.scheduler <-> services.planner.search.engine",
        "pure core: services.planner.search.engine imports services.planner.jobs.scheduler: the cost model, "
        "simulator and search take (profile, fleet, options) and do no I/O",
        "pure core: services.planner.search.engine imports grpc",
    ]


def test_every_module_has_a_layer():
    assert layer_of("services.specs.fleet") < layer_of("services.zoo.build") < layer_of("services.store.repo")
    assert layer_of("ballast.client") < layer_of("services.runtime.remote") < layer_of("ballast.cli.main")
    with pytest.raises(ValueError, match="no layer"):
        layer_of("elsewhere.module")


def test_a_jobs_layout_is_computed_in_one_place():
    """Issue 42, items 1-2: a job's stages x replicas and its rank layout come from ParallelDims
    (services/specs/parallel.py), computed from a plan by jobs/assign.pipeline_shape (or ParallelDims.of_plan)
    and read everywhere else: nobody re-derives a replica count from a stage or a stage from a rank."""
    import io
    import re
    import tokenize

    by_hand = [re.compile(p) for p in (r"stages\[0\]\.devices", r"\brank\s*(//|%)\s*\w*replica",
                                       r"\bstage\w*\s*\*\s*\w*replica\w*\s*\+", r"world\w*\s*//\s*\w*stages")]

    def code_lines(text: str) -> dict[int, str]:
        """Each line's code, strings and comments left out (a docstring may say how ranks are laid out)."""
        lines: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in (tokenize.STRING, tokenize.COMMENT) and tok.string.strip():
                lines[tok.start[0]] = lines.get(tok.start[0], "") + " " + tok.string
        return lines

    found = []
    for top in ("services", "ballast"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or path == ROOT / "services/specs/parallel.py":
                continue
            for n, code in code_lines(path.read_text()).items():
                if any(p.search(re.sub(r"\s+", " ", code).replace(" . ", ".").replace(" [", "[").replace("[ ", "[")
                                .replace(" ]", "]")) for p in by_hand):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {code.strip()}")
    assert found == []


def test_a_jobs_placement_is_computed_in_one_module_and_read_elsewhere():
    """Issue 42, item 1: a JobPlacement is built only by services/planner/jobs/assign.py (and copied by the store
    that keeps it); agents, workers, recovery and the restarted planner read it (services/specs/placement.py)."""
    import re

    builds = re.compile(r"fleet_pb2\.JobPlacement\(|\.ranks\.add\(")
    allowed = {"services/planner/jobs/assign.py", "services/store/repo/leases.py"}
    found = sorted(str(path.relative_to(ROOT)) for top in ("services", "ballast") for path in (ROOT / top).rglob("*.py")
                   if not path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
                   and builds.search(path.read_text()) and str(path.relative_to(ROOT)) not in allowed)
    assert found == []


def test_the_scheduler_composes_collaborators():
    """Issue 42, item 3: recovery, the straggler watch and the elastic pass are collaborators of the scheduler,
    not mixins of it. The scheduler inherits nothing, and each collaborator's class reaches only the private
    fields it assigns itself in __init__ (and its own methods): what it shares with the scheduler is the
    SchedulerState (state.py) and the calls it was given, never `self._store` or `self._lock` of the scheduler."""
    import ast

    from services.planner.jobs.scheduler import Scheduler

    assert Scheduler.__mro__ == (Scheduler, object)
    reached = []
    for name in ("recovery", "stragglers", "elastic", "state"):
        tree = ast.parse((ROOT / "services/planner/jobs" / f"{name}.py").read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
            init = next((f for f in methods if f.name == "__init__"), None)
            own = {f.name for f in methods} | {
                t.attr for node in (ast.walk(init) if init else ()) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in ast.walk(target) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
            used = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}
            reached += [f"{name}.py {cls.name}: self.{attr}" for attr in sorted(used - own)]
    assert reached == []
