"""Recipe vs accelerate YAML vs DeepSpeed JSON: every conflict named, with both values, before any
heavy work; impossible combinations refused with a reason."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_recipes.backends.consistency import WHOLE_TENSORS, check_consistency
from bert_recipes.backends.pipeline import PIPELINE_HEADS
from bert_recipes.backends.plan import read_launch_plan
from bert_recipes.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[1]


def plan_for(tmp_path, ds: dict | None = None, **env):
    full_env = {}
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        full_env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=str(path))
    full_env.update(env)
    return read_launch_plan(full_env)


def cfg(**overrides):
    return load_config(REPO / "recipes/tiny-mlm.yaml", [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "ds_configs").glob("*.json")))
def test_shipped_configs_agree_with_every_shipped_recipe(name, tmp_path):
    ds = json.loads((REPO / "ds_configs" / name).read_text())
    if name == "zero3_nvme.json":   # its path is a placeholder the user sets
        for kind in ("offload_optimizer", "offload_param"):
            ds["zero_optimization"][kind]["nvme_path"] = str(tmp_path)
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        c = load_config(recipe)
        validate(c)   # as preflight does first (model.architecture decided)
        if c.train.mixed_precision == "fp16":
            continue
        plan = plan_for(tmp_path, ds)
        args = dict(world_size=1, accum=c.train.global_batch_size // c.train.micro_batch_size, has_cuda=False)
        if c.optim.name in WHOLE_TENSORS and plan.zero_stage >= 1:   # LAMB's, StableAdamW's recipes name DDP; ZeRO
            with pytest.raises(ConfigError, match=f"optim.name={c.optim.name} needs whole parameter tensors"):  # refused
                check_consistency(c, plan, **args)
            continue
        if plan.pipeline and c.task.kind not in PIPELINE_HEADS:   # tiny-ner: a head the pipeline does not cut
            with pytest.raises(ConfigError, match="the pipeline engine cuts the heads of"):
                check_consistency(c, plan, **args)
            continue
        if plan.pipeline and (c.data.document_mask or c.train.global_batch_size_start):   # tiny-mlm-modern
            with pytest.raises(ConfigError, match="under the pipeline engine"):
                check_consistency(c, plan, **args)
            continue
        check_consistency(c, plan, **args)


def test_every_conflict_is_named_with_both_values(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 3, "train_batch_size": 128,
          "gradient_clipping": 0.5, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 2}}
    plan = plan_for(tmp_path, ds, ACCELERATE_MIXED_PRECISION="fp16", ACCELERATE_GRADIENT_CLIPPING="2.0")
    with pytest.raises(ConfigError) as err:
        check_consistency(cfg(), plan, world_size=2, accum=1, has_cuda=True)
    message = str(err.value)
    for expected in ["recipe train.mixed_precision=no, accelerate config mixed_precision=fp16",
                     "bf16.enabled=True",
                     "recipe train.micro_batch_size=32", "train_micro_batch_size_per_gpu=16",
                     "recipe train.global_batch_size=64", "train_batch_size=128",
                     "the recipe gives 1", "gradient_accumulation_steps=3",
                     "recipe optim.max_grad_norm=1.0", "gradient_clipping=0.5", "gradient_clipping=2.0",
                     "optimizer: recipe optim.lr=0.002, ", "optimizer.params.lr=0.01"]:
        assert expected in message, f"missing {expected!r} in:\n{message}"
    assert message.count("\n  - ") == 8


@pytest.mark.parametrize("ds, env, overrides, reason", [
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}, {}, {}, "pipeline parallelism with ZeRO-3"),
    ({"zero_optimization": {"stage": 2}}, {"ACCELERATE_USE_FSDP": "true"}, {}, "FSDP and DeepSpeed are both enabled"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, {}, {}, "offload_param to nvme needs nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/dir"}}}, {}, {},
     "nvme_path=/no/such/dir .* is not a directory on this machine"),
    (None, {}, {"train.mixed_precision": "fp16"}, "fp16 needs a CUDA GPU"),
    ({"pipeline": {"stages": 2}, "optimizer": {"type": "AdamW"}}, {}, {}, "has an optimizer or scheduler block"),
    ({"pipeline": {"stages": 2}}, {}, {"model.gradient_checkpointing": "true"},
     "model.gradient_checkpointing under the pipeline"),
    ({"pipeline": {"stages": 2}}, {}, {"train.compile": "true"}, "train.compile under the pipeline engine"),
])
def test_impossible_combinations_are_refused(tmp_path, ds, env, overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        check_consistency(cfg(**overrides), plan_for(tmp_path, ds, **env), world_size=2, accum=1, has_cuda=False)


def test_auto_and_matching_values_pass(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": "auto", "train_batch_size": 64,
          "gradient_clipping": 1.0, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    check_consistency(cfg(), plan_for(tmp_path, ds, ACCELERATE_MIXED_PRECISION="no"), world_size=2, accum=1,
                      has_cuda=False)


def test_train_py_stops_before_heavy_work(tmp_path):
    """A conflicting launch fails within seconds, with the message and no traceback."""
    ds = tmp_path / "bad.json"
    ds.write_text(json.dumps({"gradient_clipping": 0.3, "zero_optimization": {"stage": 2}}))
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds)}
    out = subprocess.run([sys.executable, "train.py", "--recipe", "recipes/tiny-mlm.yaml",
                          f"--run.output_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "clipping: recipe optim.max_grad_norm=1.0" in out.stderr and "gradient_clipping=0.3" in out.stderr
    assert not (tmp_path / "run").exists()


def test_fsdp_on_cpu_is_refused_not_run_as_ddp(tmp_path):
    """Without the test harness, Accelerate runs an FSDP config on CPU as plain DDP: refused."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "accelerate_configs/fsdp.yaml"), "--num_processes", "2", "train.py",
           "--recipe", "recipes/tiny-mlm.yaml", f"--run.output_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "asks for FSDP but Accelerate runs DistributedType.MULTI_CPU" in out.stdout + out.stderr


def test_one_backend_vocabulary_for_every_kind():
    """A plan's name is its kind's (ddp | fsdp | pipeline | zero<stage> with -offload or -nvme), read from what its
    launch files ask for: checkpoint layouts and the resume rules read it, whatever row launched it."""
    from bert_recipes.backends.plan import LaunchPlan
    zero = lambda stage, **more: {"zero_optimization": {"stage": stage, **more}}   # noqa: E731
    cases = [(LaunchPlan(), ("ddp", "ddp", 0, "none")), (LaunchPlan(fsdp=True), ("fsdp", "fsdp", 0, "none")),
             (LaunchPlan(deepspeed=True, ds_config=zero(1)), ("deepspeed", "zero1", 1, "none")),
             (LaunchPlan(deepspeed=True, ds_config=zero(2, offload_optimizer={"device": "cpu"})),
              ("deepspeed", "zero2-offload", 2, "cpu")),
             (LaunchPlan(deepspeed=True, ds_config=zero(3, offload_param={"device": "nvme"})),
              ("deepspeed", "zero3-nvme", 3, "nvme")),
             (LaunchPlan(deepspeed=True, ds_config={**zero(1), "pipeline": {"stages": 2}}), ("pipeline", "pipeline", 1, "none"))]
    for plan, expected in cases:
        assert (plan.kind, plan.name, plan.zero_stage, plan.offload) == expected


def test_each_row_is_what_its_files_say():
    """A row is data (accelerate_configs/backends.tsv): its launch files exist and are read by Accelerate's and
    DeepSpeed's own checks (LaunchPlan), and what the row claims holds of them: the CPU launch is the same backend
    as the GPU one, its variables are the kind's (DS_ACCELERATOR=cpu for DeepSpeed, never with ACCELERATE_USE_CPU,
    which would turn it into DDP), gpu-only exactly for the kinds no CPU launch runs (plan.GPU_ONLY_KINDS: FSDP,
    which Accelerate 1.15 runs as DDP on CPU processes),
    and the nodes column is the YAML's num_machines. No row's name is read for any of it."""
    from bert_recipes.backends.plan import GPU_ONLY_KINDS, KINDS, backend_rows, plan_from_config_file
    rows = backend_rows()
    assert len(rows) >= 8 and len({row.config for row in rows.values()}) == len(rows)   # one launch config a row
    for name, row in rows.items():
        plan = row.plan
        assert (REPO / row.config).is_file(), name
        if plan.deepspeed:
            assert plan.ds_config_path and plan.ds_config, name
        assert plan.kind in KINDS and plan.name, name
        assert row.nodes == plan.num_machines, (name, row.nodes, plan.num_machines)
        assert row.gpu_only == (plan.kind in GPU_ONLY_KINDS), name
        if row.gpu_only:
            continue
        cpu = plan_from_config_file(REPO / row.cpu_config)
        assert (cpu.kind, cpu.zero_stage, cpu.offload, cpu.ds_config) == (plan.kind, plan.zero_stage, plan.offload,
                                                                          plan.ds_config), name
        env = dict(item.split("=", 1) for item in row.cpu_env.split())
        deepspeed = plan.kind in ("deepspeed", "pipeline")
        assert env.get("DS_ACCELERATOR") == ("cpu" if deepspeed else None), (name, env)
        assert env.get("ACCELERATE_USE_CPU") == (None if deepspeed else "1"), (name, env)
        assert env.get("CUDA_VISIBLE_DEVICES") == "", (name, env)


def test_a_row_with_broken_columns_is_one_line(tmp_path, monkeypatch):
    """A row with a column missing (a space for a tab) is refused naming the file, the line and the columns."""
    import bert_recipes.backends.plan as plan_module
    table = tmp_path / "backends.tsv"
    table.write_text((REPO / "accelerate_configs/backends.tsv").read_text() + "zero2-x accelerate_configs/zero2.yaml\t-\t-\t1\n")
    monkeypatch.setattr(plan_module, "BACKENDS_TSV", table)
    with pytest.raises(ConfigError, match=r"backends.tsv:\d+: a row has 5 tab-separated columns"):
        plan_module.backend_rows()


def test_make_targets_use_the_tables_cpu_launch_rule():
    """`make <mode> CPU=1` prefixes the row's cpu_env and launches its cpu_config: DeepSpeed rows get
    DS_ACCELERATOR=cpu (never ACCELERATE_USE_CPU, which would silently turn them into DDP)."""
    from bert_recipes.backends.plan import backend_rows
    for name, row in backend_rows().items():
        if row.nodes > 1 or row.gpu_only:   # gpu-only: tests/test_first_hour.py
            continue
        line = subprocess.run(["make", "-n", name, "CPU=1"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        assert line.startswith(row.cpu_env + " ") and f"--config_file {row.cpu_config} " in line, line
        assert ("DS_ACCELERATOR=cpu" in line) == (row.plan.kind in ("deepspeed", "pipeline")), line
        assert "ACCELERATE_USE_CPU" not in line or "DS_ACCELERATOR" not in line, line
        gpu_line = subprocess.run(["make", "-n", name], cwd=REPO, capture_output=True, text=True, check=True,
                                  env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
                                  ).stdout.strip().splitlines()[-1]
        assert f"--config_file {row.config} " in gpu_line and "ACCELERATE_USE_CPU" not in gpu_line, gpu_line
        # GPU launches bind each rank to its GPU's NUMA node; CPU ones do not ask
        assert gpu_line.startswith("ACCELERATE_CPU_AFFINITY=1 ") and "AFFINITY" not in line, (gpu_line, line)
    env = backend_rows()["zero2"].cpu_launch_env({"ACCELERATE_USE_CPU": "1", "PATH": "/bin"})
    assert env == {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PATH": "/bin"}


def test_tools_do_not_import_train_py():
    """Tools use bert_recipes, not train.py's internals. Two exceptions, each of which runs train.py's own command
    line in its process to watch it: config_path.py traces a run of train.main; quality.py records the micro batches
    train.py's collator builds (the Trainer replays them) and applies its positive controls there."""
    for path in (REPO / "tools").glob("*.py"):
        if path.name in ("config_path.py", "quality.py"):
            continue
        text = path.read_text()
        assert "from train import" not in text and "import train\n" not in text, path


def test_the_house_stays_readable():
    """A smoke alarm, not a rule: a function in train.py or bert_recipes/ past about 100 lines, or a file of them past
    about 600, is named here for a person to look at: is it still one role? A size is a prompt to look; a function
    never moves away from its role to get under a number (docs/changing.md)."""
    import ast
    files = [REPO / "train.py"] + sorted((REPO / "bert_recipes").rglob("*.py"))
    long_functions = [f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
                      for path in files for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > 100]
    long_files = [f"{path.relative_to(REPO)} ({n} lines)" for path in files
                  if (n := path.read_text().count("\n")) > 600]
    assert not long_functions and not long_files, ("look at these: one role each?", long_functions, long_files)


def test_each_module_says_what_it_holds():
    """Every module of the package opens with a docstring: its first line says what it holds (docs/changing.md's
    map reads the same), and no two modules open with the same words."""
    import ast
    firsts = {}
    for path in sorted((REPO / "bert_recipes").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and len(doc.split()) >= 5, path
        firsts.setdefault(" ".join(doc.split()[:4]).lower(), []).append(str(path.relative_to(REPO)))
    assert not [paths for paths in firsts.values() if len(paths) > 1], firsts
