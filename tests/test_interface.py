"""The engine contracts (bert_recipes/interface.py): both engines implement every member train.py uses, with the
Protocol's parameters; every attribute is set by each engine (read from its code), and the Accelerate engine's are
there after prepare on a real run; each branch of train.py's step reads only its own engine's contract
(AccelerateStep, PipelineStep); the device is decided once. Every task kind gives the task contract (Task), and
nothing outside its file branches on the kind."""
from __future__ import annotations

import ast
import inspect
import subprocess
import textwrap
import sys

import pytest

from bert_recipes.engine import AccelerateEngine
from bert_recipes.interface import AccelerateStep, Engine, PipelineStep
from bert_recipes.backends.pipeline import PipelineEngine
from conftest import REPO

MEMBERS = tuple(Engine.__annotations__) + tuple(n for n, v in vars(Engine).items()
                                                if callable(v) and not n.startswith("_"))


def missing_members(engine) -> list[str]:
    """The Engine members `engine` lacks (attributes included: call it after prepare)."""
    return sorted(n for n in MEMBERS if not hasattr(engine, n))


@pytest.mark.parametrize("engine", [AccelerateEngine, PipelineEngine])
def test_both_engines_implement_every_method_with_its_parameters(engine):
    methods = [n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")]
    assert len(methods) >= 12 and set(methods) <= set(MEMBERS)
    for name in methods:
        ours, theirs = inspect.signature(getattr(Engine, name)), inspect.signature(getattr(engine, name))
        assert list(ours.parameters) == list(theirs.parameters), (engine.__name__, name, theirs)


def assigned_attributes(cls) -> set[str]:
    """The attributes a class sets: class attributes and every `self.<name> =` in its methods (tuple targets too)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set(vars(cls))
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


@pytest.mark.parametrize("engine", [AccelerateEngine, PipelineEngine])
def test_both_engines_set_every_attribute_of_the_interface(engine):
    attributes = set(Engine.__annotations__)
    assert {"plan", "accum", "counts_data"} <= attributes
    assert attributes - assigned_attributes(engine) == set(), engine.__name__


def test_the_check_names_a_member_an_engine_lacks():
    """The checks above are not blind: a class without the step's inputs is caught."""
    class Half:
        name = "half"

        def wrap(self, model):
            self.accum = 1
    assert {"counts_data", "plan", "prepare"} <= set(missing_members(Half())) and "name" not in missing_members(Half())
    assert "accum" in assigned_attributes(Half) and "plan" not in assigned_attributes(Half)


@pytest.mark.parametrize("engine,contract", [(AccelerateEngine, AccelerateStep), (PipelineEngine, PipelineStep)])
def test_each_engine_sets_what_its_branch_of_the_step_reads(engine, contract):
    assert len(contract.__annotations__) >= 2 and "plan" in contract.__annotations__
    assert set(contract.__annotations__) - assigned_attributes(engine) == set(), (engine.__name__, contract.__name__)


def step_reads(source: str, function: str = "train_step") -> dict[str, set[str]]:
    """The attributes `function` in `source` reads from each local name: {name: {attribute, ...}}."""
    tree = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef) and node.name == function)
    reads: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            reads.setdefault(node.value.id, set()).add(node.attr)
    return reads


def contract_breaches(source: str) -> list[str]:
    """What train_step reads from the engine outside the contracts: `engine` (run.engine) may give its plan and the
    PipelineStep's members, `step` (the same engine, as AccelerateStep) AccelerateStep's."""
    reads = step_reads(source)
    allowed = {"engine": set(PipelineStep.__annotations__), "step": set(AccelerateStep.__annotations__)}
    return sorted(f"{name}.{attr}" for name, ok in allowed.items() for attr in reads.get(name, set()) - ok)


def test_each_branch_of_the_step_reads_only_its_engines_contract():
    source = (REPO / "train.py").read_text()
    reads = step_reads(source)
    assert {"engine", "step"} <= set(reads) and "accelerator" in reads["step"], reads   # it sees both branches
    assert contract_breaches(source) == []
    # the check is not blind: the old step read the Accelerate objects straight off the engine
    assert contract_breaches(source.replace("step.accelerator", "engine.accelerator")) == ["engine.accelerator"]


def test_every_member_is_there_after_prepare_on_a_real_run(monkeypatch, tmp_path, sample_dir, datasets_cache,
                                                           shared_tokenizer):
    """A one-process run: right after prepare the Accelerate engine has every member, and so do the objects train.py's
    step reads from it (AccelerateStep's: accelerator, model, optimizer, scheduler)."""
    from conftest import run_in_process, tiny_args
    seen, prepare = [], AccelerateEngine.prepare

    def checked(self, *args):
        prepare(self, *args)
        seen.append(missing_members(self) + [n for n in AccelerateStep.__annotations__ if not hasattr(self, n)])
    monkeypatch.setattr(AccelerateEngine, "prepare", checked)
    run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2, "checkpoint.export": False}))
    assert seen == [[]]


def test_train_py_reads_the_device_from_the_plan_only():
    """The places that used to decide "on a GPU?" themselves now read the plan's decision
    (backends.plan.launch_plan_here) or take the device as an input; only decide_on_gpu asks CUDA.
    (tools/memory.py plans for a device it is told; only its --gpu-memory default reads this GPU.)"""
    asks = subprocess.run(["grep", "-rn", "torch.cuda.is_available()", "train.py", "bert_recipes", "tools/allreduce.py"], cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    assert [line.split(":")[0] for line in asks] == ["bert_recipes/backends/plan.py"], asks
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from bert_recipes.backends.plan import launch_plan_here; "
             "p = launch_plan_here({'ACCELERATE_USE_CPU': '1'}); print(p.on_gpu, p.pin_memory)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_the_plan_is_resolved_once_before_the_engine(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """preflight resolves the plan (backends.consistency.resolve_run): world, replicas, accumulation, precision,
    TF32 and the dropout masks; the recipe is compared with the launch files there, once, and the
    engines read the result. Followed on a real one-process run (tools/config_path.py): the config
    never goes back into a module already on the call stack, and the parts that build and run (engine,
    data, model, optimizer, results) take their sections, never the whole Config."""
    from accelerate.state import AcceleratorState, GradientState

    from bert_recipes.backends.consistency import resolve_run
    from bert_recipes.backends.plan import LaunchPlan
    from bert_recipes.config import load_config, validate
    from conftest import tiny_args
    sys.path.insert(0, str(REPO / "tools"))
    from config_path import follow, summary

    cfg = load_config(None, tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2, "model.dropout_impl": "packed",
        "train.tf32": True}))
    validate(cfg)   # as preflight does first (model.architecture: the checkpoint's, else bert)
    plan = resolve_run(cfg, LaunchPlan(on_gpu=False), 1)
    assert (plan.world, plan.replicas, plan.accum, plan.precision) == (1, 1, 2, "no")
    assert plan.packed_dropout and not plan.tf32   # packed masks on CPU; TF32 is a GPU setting
    pipe = LaunchPlan(deepspeed=True, ds_config={"pipeline": {"stages": 2}}, on_gpu=False)
    assert (resolve_run(cfg, pipe, 4).replicas, pipe.accum) == (2, 1)

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        result = summary(follow(cfg))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    calls = result["functions"]
    assert calls.count("bert_recipes/backends/consistency.py:check_consistency") == 1, calls
    assert calls.count("bert_recipes/config/rules.py:grad_accum_steps") == 1, calls
    assert result["cycles"] == [] and "bert_recipes/engine.py" in result["files"]
    # the whole tree goes only to what judges the recipe as a whole (docs/config.md): validate and its helpers
    # (config/rules.py, config/loading.py), the preflight and the plan's checks, and the memory planner; the rest
    # take their sections
    judges = ("rules.", "loading.", "preflight.", "consistency.", "deepspeed.", "memory.")
    assert result["whole"] and all(f.startswith(judges) for f in result["whole"]), result["whole"]
    assert (tmp_path / "run" / "metrics.json").is_file()


def package_imports() -> dict[str, set[str]]:
    """Each module of bert_recipes -> the package modules it imports, at the top or inside a function."""
    import ast
    root, graph = REPO / "bert_recipes", {}
    for path in root.rglob("*.py"):
        if path.parent != root and path.parent.name == "metrics" and path.name != "__init__.py":
            continue   # the metric scripts: loaded by evaluate, not imported
        name = ".".join(("bert_recipes", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        graph[name] = {".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                       for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.ImportFrom) and node.level}
    return {name: {t for t in targets if t in graph} for name, targets in graph.items()}


def layers() -> dict[str, int]:
    """docs/changing.md's layer table -> {module or package/ as the table writes it: its layer}."""
    import re
    text = (REPO / "docs/changing.md").read_text().split("## Layers", 1)[1]
    rows = re.findall(r"^\| (\d)\. [^|]+\|[^|]+\|(.+)\|$", text, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), rows
    return {name: int(n) for n, cells in rows for name in re.findall(r"`([^`]+)`", cells)}


def module_imports(path: Path, name: str) -> set[str]:
    """The bert_recipes modules a file imports anywhere in it: relative and absolute `from ... import`, `import
    bert_recipes.x`, and importlib.import_module with a literal name (a relative one with its package argument)."""
    import ast
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}   # `from . import x` is x
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            target = node.args[0].value
            found.add(".".join(base) + target if target.startswith(".") else target)
    return {m for m in found if m == "bert_recipes" or m.startswith("bert_recipes.")}


def test_imports_follow_the_layers(tmp_path):
    """docs/changing.md's layers: every module of the package is placed, and none imports from a layer below its
    own, not even inside a function. The control: the check sees the imports that ran against them (optim.py's
    function-local one of DeepSpeed's CPU Adam, an import_module by a literal name)."""
    placed = layers()

    def layer(module: str) -> int | None:   # the module's own row, else its nearest package's `name/` row
        parts = module.split(".")[1:]
        if "/".join(parts) in placed:
            return placed["/".join(parts)]
        return next((placed[f"{'/'.join(parts[:i])}/"] for i in range(len(parts), 0, -1)
                     if f"{'/'.join(parts[:i])}/" in placed), None)

    root, against, unplaced = REPO / "bert_recipes", [], []
    files = {".".join(("bert_recipes", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in sorted(root.rglob("*.py")) if p.parent.parent.name != "metrics"}   # (metric scripts: evaluate's)
    for name, path in files.items():
        own = layer(name)
        if own is None:
            unplaced.append(name)
            continue
        for target in sorted(module_imports(path, name) & set(files)):   # modules, not the names imported from them
            theirs = layer(target)
            if theirs > own:
                against.append(f"{name} (layer {own}) imports {target} (layer {theirs})")
    assert not unplaced, f"not in docs/changing.md's layer table: {unplaced}"
    assert not against, against
    assert layer("bert_recipes.backends.deepspeed") == 6 and layer("bert_recipes.backends.plan") == 1
    assert layer("bert_recipes.tasks") == 1 and layer("bert_recipes.tasks.mlm") == 4   # the table, a kind's file
    assert layer("bert_recipes.architectures.bert") == 2 and layer("bert_recipes.architectures") == 1
    control = tmp_path / "optim.py"
    control.write_text("import importlib\n\n\ndef build():\n    from .backends.deepspeed import cpu_adam\n"
                       "    return importlib.import_module('.engine', 'bert_recipes'), cpu_adam\n")
    seen = module_imports(control, "bert_recipes.optim") & set(files)
    assert seen == {"bert_recipes.backends.deepspeed", "bert_recipes.engine"}, seen
    assert [layer(m) for m in sorted(seen)] == [6, 6] and layer("bert_recipes.optim") == 2


SECTIONS = {"run", "task", "model", "tokenizer", "data", "optim", "train", "checkpoint", "logging"}
# where the whole config may go: the config package, preflight's entry point and the engine builders (they take it
# apart); anywhere else a function that takes it reads three sections or more, itself or through the functions it
# hands it to
WHOLE_CONFIG_ENTRIES = {("preflight", "preflight"), ("engine", "build_engine")}


def whole_config_readers() -> dict[tuple[str, str], tuple[set[str], set[str]]]:
    """(module, function) -> (the config sections it reads, the functions it hands the whole config to), for every
    function of the package with a parameter of type Config. A parameter named cfg without a type is one too (its
    type is unknown: -> {"?"}). getattr(cfg, key) and the config package's whole-tree writers read every section."""
    import ast
    found = {}
    for path in sorted((REPO / "bert_recipes").rglob("*.py")):
        module = ".".join(path.relative_to(REPO / "bert_recipes").with_suffix("").parts)
        for f in ast.walk(ast.parse(path.read_text())):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = f.args.posonlyargs + f.args.args + f.args.kwonlyargs
            typed = {a.arg: ast.unparse(a.annotation).strip("'\"") if a.annotation is not None else None for a in params}
            names = [n for n, t in typed.items() if t == "Config" or (n == "cfg" and t is None)]
            if not names:
                continue
            name, read, handed = names[0], set(), set()
            if typed[name] is None:
                read.add("?")
            for node in ast.walk(f):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
                    read |= {node.attr} & SECTIONS
                if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == name
                                                      for a in node.args + [k.value for k in node.keywords]):
                    callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if callee in {"getattr", "to_dict", "flat_dict", "to_yaml"}:
                        read |= SECTIONS
                    handed.add(callee)
            found[module, f.name] = (read, handed)
    return found


def test_the_whole_config_goes_only_where_three_sections_are_read():
    """Builders and checks take the sections they read; the whole config enters a function outside the config
    package, preflight's entry point and the engine builders only where it reads three sections or more (itself or
    through the functions it hands the config to). The control: a function that reads one section is named."""
    found = whole_config_readers()
    by_name: dict[str, list] = {}
    for (module, name), entry in found.items():
        by_name.setdefault(name, []).append(entry)

    def reads(name: str, seen: frozenset) -> set[str]:
        out = set()
        for read, handed in by_name.get(name, []):
            out |= read
            for callee in handed - seen:
                out |= reads(callee, seen | {callee})
        return out

    def narrow(found_here) -> list[str]:
        return [f"{module}.{name} takes the whole config and reads {sorted(reads(name, frozenset({name})))}"
                for (module, name) in sorted(found_here) if not module.startswith("config.")
                and (module, name) not in WHOLE_CONFIG_ENTRIES
                and ("?" in reads(name, frozenset({name})) or len(reads(name, frozenset({name})) & SECTIONS) < 3)]
    assert narrow(found) == []
    assert ("preflight", "choose_micro_batch") in found and len(reads("choose_micro_batch", frozenset())) >= 3
    by_name["control"] = [({"optim"}, set())]   # the control: ds_block_conflicts as it was, reading cfg.optim only
    assert narrow({("backends.deepspeed", "control")}) == [
        "backends.deepspeed.control takes the whole config and reads ['optim']"]


def test_no_import_circle_in_the_package():
    """Not even through a function-local import (config.validate -> metrics -> modeling -> config was one)."""
    graph = package_imports()
    assert "bert_recipes.tasks" in graph["bert_recipes.engine"], graph["bert_recipes.engine"]   # it sees them

    def circle_from(start, node, path):
        for target in sorted(graph[node]):
            if target == start:
                return path + [target]
            if target not in path:
                found = circle_from(start, target, path + [target])
                if found:
                    return found
        return None
    circles = [c for c in (circle_from(m, m, [m]) for m in sorted(graph)) if c]
    assert not circles, [" -> ".join(c) for c in circles]


# ----------------------------------------------------------------------------- task kinds
def contract_functions(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


def test_every_task_kind_gives_the_contract_with_its_parameters():
    """Each row of tasks.TASKS has its file, and the file every function of interface.Task (and TestPredictions where
    its row writes test predictions, AnswerFiles where it writes answer files), with the contract's parameters."""
    from bert_recipes.interface import AnswerFiles, Task, TestPredictions
    from bert_recipes.tasks import TASKS, kind_of
    assert set(TASKS) >= {"mlm", "classification"}
    for kind, row in TASKS.items():
        module = kind_of(kind)
        for protocol in (Task, *[TestPredictions] * row.test_predictions, *[AnswerFiles] * row.answer_files):
            names = contract_functions(protocol)
            assert names
            for name in names:
                assert hasattr(module, name), (kind, name)
                ours = list(inspect.signature(getattr(protocol, name)).parameters)[1:]   # less self
                assert list(inspect.signature(getattr(module, name)).parameters) == ours, (kind, name)


def kind_tests(source: str) -> list[str]:
    """Comparisons of a task kind (`<...>.kind` of a task, or a name `task_kind`) with a kind's name: a branch on
    the kind, where the contract or the row should answer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any((isinstance(s, ast.Attribute) and s.attr == "kind" and "task" in ast.unparse(s.value))
                    or (isinstance(s, ast.Name) and s.id == "task_kind") for s in sides)
        kinds = any(isinstance(c, ast.Constant) and c.value in ("mlm", "classification") for s in sides
                    for c in ast.walk(s))
        if named and kinds:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_a_task_kinds_file_branches_on_the_kind():
    """train.py, tools/ and every module of the package but the kinds' own files ask the contract (tasks.kind_of) or
    the row (tasks.TASKS), never `task.kind == "mlm"`; the check finds such a branch where one is written."""
    package = REPO / "bert_recipes"
    files = [REPO / "train.py", *sorted((REPO / "tools").rglob("*.py")),
             *sorted(p for p in package.rglob("*.py") if p.parent.name != "tasks")]
    branches = {str(p.relative_to(REPO)): kind_tests(p.read_text()) for p in files}
    assert not {k: v for k, v in branches.items() if v}
    assert kind_tests('if cfg.task.kind == "mlm":\n    pass\n') and kind_tests('x = task_kind != "classification"\n')
    assert not kind_tests('if plan.kind == "deepspeed":\n    pass\n')
