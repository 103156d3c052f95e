"""The backend matrix on CPU, one row of accelerate_configs/backends.tsv per test, each with real
processes: the backend really engages, the loss goes down, the ranks agree on the full weights, and
the run matches DDP on the same seed and data (dropout off)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (assert_same_weights, backend_rows, launch, refused_launched, run_in_process, snapshot,
                      started_warm, tiny_args)

ROWS = backend_rows()
NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}
STEPS = 16
# Tolerance against DDP: 1e-5 on losses and on exported weights, fp32 everywhere. The backends
# reduce gradients in other orders and buckets and ZeRO steps AdamW on flat fp32 partitions; over
# the 16 steps the largest gaps measured on CPU were 2.4e-7 (train loss) and 5.5e-7 (weights).
LOSS_TOL = 1e-5
LOSS_BAND = 0.01   # dropout on, other masks after a resume on another process count (gaps measured: docs/checkpoints.md)
WEIGHT_TOL = 1e-5
# The distributed type a run reports, by its row's engine family (LaunchPlan.kind, read from the row's configs).
ENGAGED_BY_KIND = {"ddp": "DistributedType.MULTI_CPU", "fsdp": "DistributedType.FSDP",
                   "deepspeed": "DistributedType.DEEPSPEED", "pipeline": "DEEPSPEED_PIPELINE"}
# The rows' cases, read from the table (accelerate_configs/backends.tsv) and from each row's launch files (its
# LaunchPlan: kind, ZeRO stage, offload), never from its name: a new row joins them with no code.
PLANS = {name: row.plan for name, row in ROWS.items()}
ONE_NODE = [name for name, row in ROWS.items() if row.nodes == 1]
ZERO_ROWS = [name for name in ONE_NODE if PLANS[name].kind == "deepspeed" and PLANS[name].offload != "nvme"]
SHARDED_STATE_ROWS = ZERO_ROWS + [name for name in ONE_NODE if PLANS[name].kind == "fsdp"]   # optimizer states split
NOT_AUDITED = {**{name: "test_zero3_nvme_row runs it (libaio, an NVMe path)" for name in ROWS
                  if PLANS[name].offload == "nvme"},
               **{name: "a ZeRO launch on two nodes: its one-node twin is audited" for name in ROWS
                  if ROWS[name].nodes > 1 and PLANS[name].kind == "deepspeed"}}
AUDITED_ROWS = [name for name in ROWS if name not in NOT_AUDITED]


def engaged(name: str) -> str:
    return ENGAGED_BY_KIND[PLANS[name].kind]


def common(shared_tokenizer, **extra):
    return {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": STEPS,
            "train.eval_every": 8, "checkpoint.save_every": 8, "logging.sync_audit": True, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("backends")


@pytest.fixture(scope="module")
def row_run(runs, sample_dir, datasets_cache, shared_tokenizer):
    """run(name) -> (out, metrics): the row's 16-step run, launched once per module, by whichever
    test needs it first (so a resume or export test selected alone still has its row)."""
    done = {}

    def run(name: str):
        if name not in done:
            out = runs / name
            done[name] = out, launch(2, tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer)),
                                     backend=name)
        return done[name]
    return run


@pytest.fixture(scope="module")
def ddp_reference(row_run):
    return row_run("ddp")


def history(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["history"]


def assert_matches_ddp(out: Path, reference: Path):
    ours, ref = history(out), history(reference)
    assert [r["step"] for r in ours["train"]] == [r["step"] for r in ref["train"]]
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(ours["train"], ref["train"])]
    assert max(gaps) < LOSS_TOL, f"train loss vs DDP, gaps {gaps}"
    eval_gaps = [abs(a["eval_loss"] - b["eval_loss"]) for a, b in zip(ours["eval"], ref["eval"])]
    assert max(eval_gaps) < LOSS_TOL, f"eval loss vs DDP, gaps {eval_gaps}"
    wa, wb = load_file(out / "model/model.safetensors"), load_file(reference / "model/model.safetensors")
    assert wa.keys() == wb.keys()
    worst = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    print(f"[vs DDP] {out.name}: train loss {max(gaps):.1e}, eval loss {max(eval_gaps):.1e}, weights {worst:.1e}")
    assert worst < WEIGHT_TOL, f"exported weights vs DDP: max abs diff {worst}"


def assert_healthy(metrics: dict, distributed_type: str):
    final = metrics["final"]
    assert final["num_processes"] == 2, final
    assert final["backend"]["distributed_type"] == distributed_type, final["backend"]
    losses = [r["loss"] for r in metrics["history"]["train"]]
    assert all(l == l and abs(l) != float("inf") for l in losses) and losses[-1] < losses[0] - 0.3, losses
    checksums = final["rank_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    assert final["eval_samples"] == final["eval_dataset_size"]


def test_ddp_reference_is_healthy(ddp_reference):
    out, metrics = ddp_reference
    assert_healthy(metrics, "DistributedType.MULTI_CPU")
    assert metrics["final"]["backend"]["params_sharded"] is False


def test_the_warm_start_changes_nothing_a_run_computes(ddp_reference, runs, sample_dir, datasets_cache,
                                                        shared_tokenizer):
    """The suite forks its processes from a server that has imported everything once (tests/warm/): the DDP
    row started cold, every process a plain interpreter, computes the same run to the bit."""
    out, warm = ddp_reference
    if not started_warm(str(out)):
        pytest.skip("the warm start is off (BERT_RECIPES_WARM=0) or was not up yet")
    assert started_warm(str(out)) == 3   # the launcher and its two ranks
    cold = launch(2, tiny_args(runs / "ddp-cold", sample_dir, datasets_cache, **common(shared_tokenizer)),
                  backend="ddp", env={"BERT_RECIPES_WARM": "0"})
    assert not started_warm(str(runs / "ddp-cold"))
    assert_healthy(cold, "DistributedType.MULTI_CPU")
    assert cold["history"] == warm["history"] | {"train": cold["history"]["train"]}   # evaluations: equal
    for a, b in zip(cold["history"]["train"], warm["history"]["train"]):
        assert {k: v for k, v in a.items() if not timed(k)} == {k: v for k, v in b.items() if not timed(k)}
    assert cold["final"]["rank_checksums"] == warm["final"]["rank_checksums"]


def timed(key: str) -> bool:
    """A history column that measures time (throughput, waits), not what was computed."""
    return key.endswith(("_per_sec", "_s", "_share", "_worst")) or key == "mfu"


@pytest.mark.parametrize("name", ZERO_ROWS)
def test_deepspeed_rows(name, row_run, ddp_reference):
    """What engaged (stage, offload, measured sharding) is what the row's config asks for, in the one
    backend vocabulary (bert_recipes.backends.plan.LaunchPlan; tests/test_consistency.py pins it)."""
    out, metrics = row_run(name)
    assert_healthy(metrics, "DistributedType.DEEPSPEED")
    backend, plan = metrics["final"]["backend"], PLANS[name]
    shards_params = plan.zero_stage == 3   # ZeRO-3 partitions the parameters; ZeRO-1/2 the optimizer states
    assert backend["name"] == plan.name, backend   # the kind's name (the row's label is the Make target's)
    assert backend["zero_stage"] == plan.zero_stage and backend["params_sharded"] is shards_params, backend
    assert backend["offload_optimizer"] is (plan.offload != "none"), backend
    if shards_params:   # each rank holds about half of the parameter elements
        assert backend["local_param_numel"] <= 0.6 * backend["full_param_numel"], backend
    assert_matches_ddp(out, ddp_reference[0])


def _libaio_available() -> bool:
    import ctypes.util
    return ctypes.util.find_library("aio") is not None


# NVMe offload swaps a tensor of at least 1 MiB (DeepSpeed's MIN_AIO_BYTES). Hidden 64 x intermediate
# 16384 gives each rank 2 MiB (fp32) of each MLP matrix, 4 of them over the 2 layers: the parameters
# swap (and in bf16, DeepSpeed 0.19.8's choice on a CPU without fp16 support, they still would, and the
# fp32 forward then fails on mixed dtypes). Intermediate 2048 keeps every tensor under 1 MiB, even on one
# rank (the row's checkpoint is resumed by one process), while the optimizer's flat fp32 partitions (1.3 MB
# a rank of 2) swap. With the optimizer on NVMe, DeepSpeed
# 0.19.8 also swaps gradient partitions of 1 MiB or more, and on CPU processes its updates then come out
# wrong: refused (backends/deepspeed.py: check_nvme_gradient_swap; tests/test_bad_input.py launches that refusal).
SWAPS_PARAMETERS = {"model.hidden_size": 64, "model.intermediate_size": 16384}
SWAPS_OPTIMIZER_ONLY = {"model.hidden_size": 64, "model.intermediate_size": 2048}
MIB = 2 ** 20


def nvme_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, model: dict, offload: dict):
    """DDP, then the zero3-nvme row (its JSON, with `offload` merged in and a tmp dir for the NVMe
    mount), on the same model. -> (metrics, the files on the "NVMe" at step 4 {path: bytes}, nvme dir)"""
    from conftest import launch_watched
    repo = Path(__file__).resolve().parents[1]
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ds = json.loads((repo / "ds_configs/zero3_nvme.json").read_text())
    for kind in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][kind].update(nvme_path=str(nvme), **offload.get(kind, {}))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    yaml_text = (repo / "accelerate_configs/zero3_nvme.yaml").read_text()
    (tmp_path / "acc.yaml").write_text(yaml_text.replace("ds_configs/zero3_nvme.json", str(tmp_path / "ds.json")))
    settings = common(shared_tokenizer, **model, **{"logging.log_every": 1, "train.max_steps": 8,
                                                    "train.eval_every": 4, "checkpoint.save_every": 4})
    ddp = launch(2, tiny_args(tmp_path / "ddp", sample_dir, datasets_cache, **settings), backend="ddp")
    assert ddp["final"]["num_processes"] == 2
    seen = {}

    def react(line, proc):   # mid-run: what lies on the "NVMe"
        if "[train] step 4/" in line and not seen:
            seen.update({str(p.relative_to(nvme)): p.stat().st_size for p in nvme.rglob("*") if p.is_file()})
            return True
        return False
    out = tmp_path / "zero3-nvme"
    code, log, _ = launch_watched(tiny_args(out, sample_dir, datasets_cache, **settings), react, backend="zero3-nvme",
                                  config=tmp_path / "acc.yaml", timeout=1200, script="tests/checksum_harness.py")
    assert code == 0, log[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert_healthy(metrics, "DistributedType.DEEPSPEED")
    backend = metrics["final"]["backend"]
    assert backend["offload_param"] and backend["offload_optimizer"] and backend["params_sharded"], backend
    assert_matches_ddp(out, tmp_path / "ddp")
    assert not [p for p in nvme.rglob("*") if p.is_file()], "swap files left behind"   # the run clears its own
    return metrics, seen


@pytest.mark.skipif(not _libaio_available(), reason="NVMe offload needs libaio (apt-get install libaio-dev; .ci/run does)")
def test_zero3_nvme_row(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """The row as shipped (ds_configs/zero3_nvme.json: parameters and optimizer to NVMe, a tmp dir for
    the mount), fp32: while it trains, the optimizer's fp32 partitions (master weights and both Adam
    moments, 3 x 4 bytes a parameter) are files on the disk, and the run matches DDP."""
    metrics, seen = nvme_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, SWAPS_OPTIMIZER_ONLY, {})
    per_rank = metrics["final"]["backend"]["full_param_numel"] // 2
    assert sum(seen.values()) >= 2 * 3 * 4 * per_rank * 0.95, seen
    assert metrics["final"]["backend"]["param_dtypes"] == ["torch.float32"]
    # a phase from its weights alone under another backend: DeepSpeed's zero_to_fp32 cannot read fp32 partitions
    # swapped to the disk: one line, before any rank trains, naming the ways that work
    error = refused_launched(tiny_args(tmp_path / "phase", sample_dir, datasets_cache, **common(
        shared_tokenizer, **SWAPS_OPTIMIZER_ONLY, **{"checkpoint.init_from": str(tmp_path / "zero3-nvme")})),
        tmp_path, "zero2")
    assert "keeps its fp32 weights in DeepSpeed's NVMe swap files" in error and "model.name_or_path=" in error, error
    # its step-4 checkpoint on one process: the optimizer states swapped to the "NVMe" are files DeepSpeed's
    # universal converter does not read, so this resume is refused in one line and nothing is written
    full = tmp_path / "zero3-nvme"
    error = refused_launched(tiny_args(tmp_path / "one", sample_dir, datasets_cache, **common(
        shared_tokenizer, **SWAPS_OPTIMIZER_ONLY, **{"checkpoint.resume": str(full / "checkpoints/step_00000004")})),
        tmp_path, "zero3-nvme", config=tmp_path / "acc.yaml")   # tmp_path: no run directory, no universal conversion
    assert "ZeRO's states offloaded to NVMe are not re-cut" in error and "resume on 2 processes (NPROC=2)" in error, error


@pytest.mark.skipif(not _libaio_available(), reason="NVMe offload needs libaio (apt-get install libaio-dev; .ci/run does)")
def test_zero3_nvme_parameters_stay_fp32(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Parameters on NVMe while training (max_in_cpu=1: none brought back to host memory; the
    optimizer in host memory, see above), fp32: each rank's 4 MLP partitions are 2 MiB files on the
    disk (1 MiB if DeepSpeed held them in bf16, as 0.19.8 does on a CPU without fp16 support unless
    backends/deepspeed.py's zero3_keeps_model_dtype steps in), DeepSpeed holds them in fp32, and the run matches DDP."""
    metrics, seen = nvme_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, SWAPS_PARAMETERS, {
        "offload_param": {"max_in_cpu": 1, "buffer_size": MIB}, "offload_optimizer": {"device": "cpu"}})
    backend = metrics["final"]["backend"]
    assert backend["param_dtypes"] == ["torch.float32"] and backend["params_on_nvme"] >= 4, backend
    assert sorted(seen.values()) == [2 * MIB] * 8, seen


@pytest.mark.parametrize("name", AUDITED_ROWS)
def test_no_host_waits_between_log_steps(name, row_run):
    """logging.sync_audit (bert_recipes.sync_audit.SyncAudit) counts, in the steps between log steps, every call
    that would make the host wait for a GPU (a tensor read as a number or copied to the host, a boolean-
    mask index, synchronize). None under DDP (one node or two) and FSDP2: the loss, the counts and the
    skip decisions stay on the device. Under DeepSpeed only its own step's, each named with its line in
    tests/deepspeed_syncs.py's DEEPSPEED_SYNCS."""
    from deepspeed_syncs import allowed_deepspeed_sync
    _, metrics = row_run(name)
    sites = metrics["final"]["sync_audit"]
    per_window = [row["host_syncs"] for row in metrics["history"]["train"]]
    print(f"[host waits] {name}: {per_window} per {metrics['config']['logging/log_every']} steps; {sites}")
    assert len(per_window) == STEPS // 4 and all(count >= 0 for count in per_window)
    if PLANS[name].kind in ("ddp", "fsdp"):
        assert sites == {} and set(per_window) == {0}, sites
    else:
        assert sites and all(allowed_deepspeed_sync(site) for site in sites), sites


def test_fsdp_row(row_run, ddp_reference):
    out, metrics = row_run("fsdp")
    assert_healthy(metrics, "DistributedType.FSDP")
    backend = metrics["final"]["backend"]
    assert backend["params_sharded"] and backend["local_param_numel"] <= 0.6 * backend["full_param_numel"], backend
    assert_matches_ddp(out, ddp_reference[0])


def test_multinode_row(row_run, ddp_reference):
    """2 "machines" x 1 process on 127.0.0.1, machine_rank 0 and 1."""
    out, metrics = row_run("multinode")
    assert_healthy(metrics, "DistributedType.MULTI_CPU")
    assert_matches_ddp(out, ddp_reference[0])


def test_pipeline_row(row_run, ddp_reference):
    """2 stages x 1 replica. Each rank owns one stage's layers only; the word embeddings and the
    MLM decoder stay one tied weight across the two stages; same batches as DDP, so same losses."""
    out, metrics = row_run("pipeline")
    final = metrics["final"]
    backend = final["backend"]
    assert final["num_processes"] == 2 and backend["pipeline_stages"] == 2 and backend["data_parallel_size"] == 1
    assert sorted(r["stage_id"] for r in backend["ranks"]) == [0, 1]
    assert all(r["local_param_numel"] < backend["full_param_numel"] for r in backend["ranks"]), backend
    losses = [r["loss"] for r in metrics["history"]["train"]]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(0 < r["mfu"] < 1 and 0 <= r["data_wait_share"] <= r["data_wait_worst"] + 1e-9 < 1
               for r in metrics["history"]["train"])   # the worst rank's wait: stage 0 (the later one has no loader)
    assert final["eval_samples"] == final["eval_dataset_size"]
    assert_matches_ddp(out, ddp_reference[0])
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(out / "model")   # tied again in the export
    assert torch.equal(model.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)


def test_pipeline_classification_and_data_parallel(runs, ddp_reference, tmp_path, sample_dir, datasets_cache):
    """Classification through the pipeline, 2 stages x 2 data-parallel replicas = 4 processes,
    starting from the DDP export; its export is an ordinary BertForSequenceClassification, and its
    TensorBoard points come from the same trackers as every other backend's (logs.Trackers)."""
    export = runs / "ddp/model"
    settings = {**NO_DROPOUT, "model.name_or_path": export, "train.max_steps": 8, "train.global_batch_size": 16,
                "train.micro_batch_size": 4, "checkpoint.save_every": 4}
    metrics = launch(4, tiny_args(tmp_path / "pipe_cls", sample_dir, datasets_cache, task="classification", **settings,
                                  **{"logging.trackers": "[tensorboard]"}), backend="pipeline")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = [EventAccumulator(str(f.parent)).Reload() for f in (tmp_path / "pipe_cls/logs").rglob("events.out.tfevents.*")]
    steps = [e.step for acc in events if "train/loss" in acc.Tags()["scalars"] for e in acc.Scalars("train/loss")]
    assert steps == [4, 8], steps   # log_every 4, written once (rank 0)
    backend = metrics["final"]["backend"]
    assert backend["pipeline_stages"] == 2 and backend["data_parallel_size"] == 2
    assert sorted(r["stage_id"] for r in backend["ranks"]) == [0, 0, 1, 1]
    assert metrics["final"]["eval_samples"] == metrics["final"]["eval_dataset_size"]
    assert metrics["final"]["last_train_loss"] < metrics["final"]["first_train_loss"]
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "pipe_cls/model")
    assert type(model).__name__ == "BertForSequenceClassification" and model.classifier.out_features == 8

    # its step-4 checkpoint continued by 2 stages x 1 replica: the replicas' ZeRO-1 partitions re-cut through
    # DeepSpeed's universal checkpoint; the uninterrupted run's weights (tolerance 1e-5)
    one = launch(2, tiny_args(tmp_path / "one_replica", sample_dir, datasets_cache, task="classification", **settings,
                              **{"checkpoint.resume": str(tmp_path / "pipe_cls/checkpoints/step_00000004")}),
                 backend="pipeline")
    assert one["final"]["num_processes"] == 2 and one["final"]["backend"]["data_parallel_size"] == 1
    assert one["final"]["backend"]["distributed_type"] == engaged("pipeline")
    assert ("the world size changed, 4 -> 2 processes: the global batch stays micro 4 x accum 4 x 1 replicas (was "
            "micro 4 x accum 2 x 2 replicas)") in (tmp_path / "one_replica.log").read_text()
    assert_same_weights(tmp_path / "pipe_cls/model/model.safetensors", tmp_path / "one_replica/model/model.safetensors",
                        WEIGHT_TOL)


@pytest.mark.parametrize("name", ["zero3", "fsdp"])   # the pipeline's: test_pipeline_resume_with_dropout_is_exact
def test_sharded_resume_equals_uninterrupted(name, row_run, tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Halt at step 8 (after its checkpoint), resume from the sharded checkpoint, finish at 16:
    the weights equal the uninterrupted run of the same row (tolerance 1e-6)."""
    full, _ = row_run(name)
    args = tiny_args(tmp_path / "split", sample_dir, datasets_cache, **common(shared_tokenizer))
    halted = launch(2, args + ["train.halt_at_step=8"], backend=name)
    assert halted["final"] == {"steps": 8, "halted": True}
    resumed = launch(2, args + ["checkpoint.resume=auto"], backend=name)
    assert "[resume] from" in (tmp_path / "split.log").read_text()
    assert resumed["final"]["steps"] == STEPS and resumed["final"]["num_processes"] == 2
    assert resumed["final"]["backend"]["distributed_type"] == engaged(name)
    assert resumed["final"]["backend"]["params_sharded"] is True
    assert_same_weights(full / "model/model.safetensors", tmp_path / "split/model/model.safetensors", tol=1e-6)


@pytest.mark.parametrize("name", AUDITED_ROWS)
def test_a_checkpoints_full_weights_are_its_export(name, row_run):
    """backends/saved_weights.py: the fp32 weights of the row's last checkpoint (step 16), read whole with its
    format's own tool (safetensors, torch's DCP, DeepSpeed's zero_to_fp32, its universal checkpoint for the
    pipeline), are the run's export, bit for bit: what a phase under any backend and process count starts from."""
    assert_last_checkpoint_reads_as_export(row_run(name)[0], STEPS)


def assert_last_checkpoint_reads_as_export(out: Path, steps: int):
    from transformers import AutoModelForMaskedLM

    from bert_recipes.backends.saved_weights import convert_once, saved_weights
    from bert_recipes.checkpoint import complete_checkpoints
    last = complete_checkpoints(out)[-1]
    assert last.name == f"step_{steps:08d}"
    export = load_file(out / "model/model.safetensors")
    convert_once(last)
    read = saved_weights(last, AutoModelForMaskedLM.from_pretrained(out / "model"), "mlm")
    assert set(export) <= set(read), set(export) - set(read)
    for key, value in export.items():
        assert torch.equal(read[key], value), key


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_sharded_export_holds_full_weights(name, row_run, runs, ddp_reference):
    """The export holds full weights: plain from_pretrained loads it, every tensor has its full shape
    (the row's test compares each with DDP's within 1e-5), and it is an ordinary BertForMaskedLM that a
    fine-tuning run starts from like any other (tests/test_train.py fine-tunes such exports)."""
    from transformers import AutoModelForMaskedLM
    export = row_run(name)[0] / "model"
    model = AutoModelForMaskedLM.from_pretrained(export)
    reference = AutoModelForMaskedLM.from_pretrained(runs / "ddp/model")
    assert type(model).__name__ == "BertForMaskedLM"
    assert model.state_dict().keys() == reference.state_dict().keys()
    for k, v in model.state_dict().items():   # full tensors, not shards
        assert v.shape == reference.state_dict()[k].shape, k


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_gradient_accumulation_equivalence(name, tmp_path, runs, ddp_reference, sample_dir, datasets_cache):
    """micro 2 x accumulate 4 == micro 8 x accumulate 1 (x 2 ranks). Classification: every sample
    weighs the same in the loss, so the two are the same maths; tolerance 1e-4 on losses."""
    export = runs / "ddp/model"
    results = {}
    for micro in (8, 2):
        out = tmp_path / f"micro{micro}"
        results[micro] = launch(2, tiny_args(out, sample_dir, datasets_cache, task="classification", **{
            **NO_DROPOUT, "model.name_or_path": export, "train.max_steps": 8, "train.global_batch_size": 16,
            "train.micro_batch_size": micro, "train.eval_every": 4}), backend=name)
    for r in results.values():   # really 2 ranks, really the backend asked for
        assert r["final"]["num_processes"] == 2
        assert r["final"]["backend"]["distributed_type"] == engaged(name)
        assert r["final"]["backend"].get("zero_stage", 2) == 2
    a, b = results[8]["history"], results[2]["history"]
    for ra, rb in zip(a["train"], b["train"]):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-4), (ra, rb)
    for ra, rb in zip(a["eval"], b["eval"]):
        assert ra["accuracy"] == rb["accuracy"]
    assert results[2]["final"]["eval_samples"] == results[8]["final"]["eval_samples"]


def test_epochs_give_the_same_steps_and_schedule_under_ddp_and_the_pipeline(tmp_path, sample_dir, datasets_cache,
                                                                           shared_tokenizer):
    """One loop for every engine: 216 sequences in micro batches of 8 are 27 batches. DDP (2 ranks,
    accumulation 4) gives each rank 13, the pipeline (2 stages x 1 replica, accumulation 8) reads
    all 27; neither divides, and both train 3 full 64-sequence steps per epoch (the incomplete
    last step of an epoch is dropped), so 2 epochs are 6 steps with the same lr at every step and,
    on the same batches, the same losses."""
    args = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "data.max_train_samples": 216,
            "train.global_batch_size": 64, "train.micro_batch_size": 8, "train.max_steps": "null",
            "train.epochs": 2, "optim.warmup_steps": 2, "logging.log_every": 1}
    runs = {name: launch(2, tiny_args(tmp_path / name, sample_dir, datasets_cache, task="classification", **args),
                         backend=name) for name in ("ddp", "pipeline")}
    ddp, pipe = runs["ddp"], runs["pipeline"]
    assert ddp["final"]["num_processes"] == 2 and ddp["final"]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert pipe["final"]["num_processes"] == 2 and pipe["final"]["backend"]["pipeline_stages"] == 2
    for metrics in runs.values():
        assert metrics["final"]["steps"] == 6
        assert [r["step"] for r in metrics["history"]["train"]] == [1, 2, 3, 4, 5, 6]
        assert [r["epoch"] for r in metrics["history"]["train"]] == [round(s / 3, 3) for s in range(1, 7)]
    lrs = {name: [r["lr"] for r in m["history"]["train"]] for name, m in runs.items()}
    assert lrs["ddp"] == lrs["pipeline"], lrs
    assert lrs["ddp"][1] == pytest.approx(2e-3) and lrs["ddp"][-1] == 0.0   # warmup 2, linear decay to 0 at step 6
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(ddp["history"]["train"], pipe["history"]["train"])]
    assert max(gaps) < 1e-4, gaps


def to_old_rng_format(checkpoint):
    """Rewrite a checkpoint's random states (Accelerate's random_states_<r>.pkl, which every engine
    writes now) as the pipeline's earlier rng_rank<r>.json, as a checkpoint from before looks."""
    from accelerate.utils import load
    files = sorted(checkpoint.glob("random_states_*.pkl"))
    assert len(files) == 2, files
    for path in files:
        s = load(path)
        version, internal, gauss = s["random_state"]
        kind, keys, pos, has_gauss, cached = s["numpy_random_seed"]
        old = {"torch": s["torch_manual_seed"].tolist(), "cuda": None, "python": [version, list(internal), gauss],
               "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
        (checkpoint / f"rng_rank{path.stem.rsplit('_', 1)[1]}.json").write_text(json.dumps(old))
        path.unlink()
    manifest = checkpoint / "manifest.json"   # the damage check must see the old files, as it did then
    if manifest.exists():
        from bert_recipes.checkpoint import write_manifest
        write_manifest(checkpoint)


def test_pipeline_resume_with_dropout_is_exact(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Dropout on (BERT's 0.1): the pipeline's checkpoint carries every rank's random state (DeepSpeed
    keeps none), so halting at 8 and resuming ends with the uninterrupted run's weights; a checkpoint
    in the earlier rng_rank<r>.json format resumes exactly too."""
    def args(name):
        return tiny_args(tmp_path / name, sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": STEPS, "checkpoint.save_every": 8})
    full = launch(2, args("full"), backend="pipeline")
    assert full["final"]["backend"]["pipeline_stages"] == 2 and full["final"]["num_processes"] == 2
    launch(2, args("split") + ["train.halt_at_step=8"], backend="pipeline")
    to_old_rng_format(tmp_path / "split/checkpoints/step_00000008")   # written before the one format: still exact
    resumed = launch(2, args("split") + ["checkpoint.resume=auto"], backend="pipeline")
    assert resumed["final"]["steps"] == STEPS
    import yaml
    assert yaml.safe_load((tmp_path / "split/config.yaml").read_text())["model"]["hidden_dropout_prob"] is None   # 0.1
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "split/model/model.safetensors", tol=1e-6)


def test_ddp_resumes_on_another_number_of_processes(row_run, tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                    capsys):
    """2 -> 1: the DDP row's step-8 checkpoint, resumed by one process (accumulation 2 instead of 2 ranks),
    ends with the uninterrupted 2-process run's weights: step k trains on the same micro batches whatever the
    process count (tolerance 1e-5: the gradients are summed in another order). 1 -> 2 the same way round."""
    full, _ = row_run("ddp")
    args = lambda out, **extra: tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **extra))  # noqa: E731
    run_in_process(args(tmp_path / "one", **{"checkpoint.resume": str(full / "checkpoints/step_00000008")}))
    out = capsys.readouterr().out
    assert ("[resume] the world size changed, 2 -> 1 processes: the global batch stays micro 8 x accum 2 x 1 "
            "replicas (was micro 8 x accum 1 x 2 replicas); step k trains on the same micro batches") in out, out[-3000:]
    assert_same_weights(full / "model/model.safetensors", tmp_path / "one/model/model.safetensors", WEIGHT_TOL)

    # and back: one process, halted at step 8, continued by two, ends with the row's weights too
    assert run_in_process(args(tmp_path / "single", **{"train.halt_at_step": 8})) == {"steps": 8, "halted": True}
    resumed = launch(2, args(tmp_path / "two", **{"checkpoint.resume": str(tmp_path / "single/checkpoints/step_00000008")}))
    assert resumed["final"]["num_processes"] == 2 and resumed["final"]["steps"] == STEPS
    assert resumed["final"]["backend"]["distributed_type"] == engaged("ddp")
    assert "the world size changed, 1 -> 2 processes" in (tmp_path / "two.log").read_text()
    assert_same_weights(full / "model/model.safetensors", tmp_path / "two/model/model.safetensors", WEIGHT_TOL)


def test_with_dropout_a_resume_on_fewer_processes_stays_in_the_band(tmp_path, sample_dir, datasets_cache,
                                                                     shared_tokenizer):
    """Dropout on (the recipe's 0.1): a DDP run's step-8 checkpoint continued by one process draws other
    dropout masks (per-rank streams), so it cannot equal the uninterrupted run; its losses stay within
    LOSS_BAND of it at every logged step after the resume."""
    with_dropout = {k: v for k, v in common(shared_tokenizer).items() if k not in NO_DROPOUT}
    full = launch(2, tiny_args(tmp_path / "full", sample_dir, datasets_cache, **with_dropout))
    one = launch(1, tiny_args(tmp_path / "one", sample_dir, datasets_cache, **with_dropout, **{
        "checkpoint.resume": str(tmp_path / "full/checkpoints/step_00000008")}))
    assert full["final"]["num_processes"] == 2 and one["final"]["num_processes"] == 1
    assert {full["final"]["backend"]["distributed_type"], one["final"]["backend"]["distributed_type"]} == {engaged("ddp")}
    assert "the world size changed, 2 -> 1 processes" in (tmp_path / "one.log").read_text()
    ours = {r["step"]: r["loss"] for r in one["history"]["train"] if r["step"] > 8}
    theirs = {r["step"]: r["loss"] for r in full["history"]["train"] if r["step"] > 8}
    assert sorted(ours) == sorted(theirs) == [12, 16], (ours, theirs)
    gaps = [abs(ours[k] - theirs[k]) for k in ours] + [abs(one["final"]["eval_loss"] - full["final"]["eval_loss"])]
    print("dropout-on gaps (train 12, train 16, eval):", gaps)
    assert max(gaps) < LOSS_BAND and ours != theirs, (ours, theirs)   # other masks: not equal, but close


@pytest.mark.parametrize("name", SHARDED_STATE_ROWS)
def test_sharded_states_resume_on_another_number_of_processes(name, row_run, tmp_path, sample_dir, datasets_cache,
                                                              shared_tokenizer):
    """2 -> 1: the row's step-8 checkpoint, loaded by one process, and the run ends with the uninterrupted
    2-process run's weights (tolerance 1e-5: another summation order). ZeRO's partitions are re-cut through
    DeepSpeed's universal checkpoint (its own converter, run once); FSDP2's shards by torch's distributed
    checkpoint. (ZeRO-3 with the optimizer on NVMe: test_zero3_nvme_row.)"""
    full, metrics = row_run(name)
    out = tmp_path / "one"
    resumed = launch(1, tiny_args(out, sample_dir, datasets_cache, **common(
        shared_tokenizer, **{"checkpoint.resume": str(full / "checkpoints/step_00000008")})), backend=name)
    assert resumed["final"]["steps"] == STEPS and resumed["final"]["num_processes"] == 1
    # the run's record and schedule carry over: the rows logged before the checkpoint, the same learning rates
    rows = lambda m: [(r["step"], r["lr"]) for r in m["history"]["train"]]  # noqa: E731
    assert rows(resumed) == rows(metrics) and resumed["history"]["train"][:2] == metrics["history"]["train"][:2]
    assert resumed["final"]["backend"]["name"] == PLANS[name].name
    assert resumed["final"]["backend"]["distributed_type"] == engaged(name)
    log = (tmp_path / "one.log").read_text()
    assert "[resume] the world size changed, 2 -> 1 processes" in log, log[-3000:]
    if PLANS[name].kind == "deepspeed":
        assert "universal checkpoint" in log
        assert (full / "checkpoints/step_00000008/universal/pytorch_model/zero").is_dir()
    assert_same_weights(full / "model/model.safetensors", out / "model/model.safetensors", WEIGHT_TOL)


def test_a_failed_universal_conversion_is_one_line(tmp_path):
    """DeepSpeed's converter on a checkpoint it cannot read: one config error line naming the checkpoint and
    the fix, and no universal directory (not even a partial one) left behind."""
    from bert_recipes.backends.deepspeed_universal import universal_checkpoint
    from bert_recipes.config import ConfigError
    (tmp_path / "pytorch_model").mkdir()
    with pytest.raises(ConfigError, match=r"could not be converted to DeepSpeed's universal checkpoint .*resume on "
                                          r"the process count it was saved with") as err:
        universal_checkpoint(tmp_path)
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model"]


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_sharded_states_resume_on_more_processes(name, row_run, tmp_path, sample_dir, datasets_cache,
                                                shared_tokenizer):
    """1 -> 2, the other way round: a one-process run halted at step 8, continued by two processes, ends with
    the uninterrupted 2-process row's weights (tolerance 1e-5)."""
    full, _ = row_run(name)
    args = lambda out, **extra: tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **extra))  # noqa: E731
    single = launch(1, args(tmp_path / "single", **{"train.halt_at_step": 8}), backend=name)
    assert single["final"] == {"steps": 8, "halted": True}
    two = launch(2, args(tmp_path / "two", **{"checkpoint.resume": str(tmp_path / "single/checkpoints/step_00000008")}),
                 backend=name)
    assert two["final"]["num_processes"] == 2 and two["final"]["steps"] == STEPS
    assert two["final"]["backend"]["distributed_type"] == engaged(name) and two["final"]["backend"]["params_sharded"]
    assert "the world size changed, 1 -> 2 processes" in (tmp_path / "two.log").read_text()
    assert_same_weights(full / "model/model.safetensors", tmp_path / "two/model/model.safetensors", WEIGHT_TOL)


def test_a_backend_and_process_count_change_is_one_line(row_run, tmp_path, sample_dir, datasets_cache,
                                                        shared_tokenizer):
    """ZeRO-2's step-8 checkpoint (2 processes) resumed by one process under ZeRO-3: one config error line
    naming both layouts and the fix, before any rank trains (it was DeepSpeed's ZeRORuntimeException
    traceback), nothing written."""
    full, _ = row_run("zero2")
    checkpoints = snapshot(full / "checkpoints")
    error = refused_launched(tiny_args(tmp_path / "zero3", sample_dir, datasets_cache, **common(
        shared_tokenizer, **{"checkpoint.resume": str(full / "checkpoints/step_00000008")})), tmp_path, "zero3")
    assert ("was saved by 2 processes under zero2 (2 data-parallel replicas) and this run has 1 under zero3 (1 "
            "data-parallel replicas): an optimizer's state is carried over only under the backend that saved it; "
            "resume under zero2 (on any process count), or start a phase from its weights alone under zero3 "
            "(checkpoint.init_from=" in error), error
    assert snapshot(full / "checkpoints") == checkpoints   # no universal conversion either


@pytest.mark.parametrize("stage", [2, 3])
def test_the_universal_load_mends_only_zero3s_slips(stage):
    """loading_universal around what DeepSpeed 0.19.8's ZeRO-3 universal load leaves (every group given group
    0's hyperparameters, one `step` tensor shared by every group's state; here done by hand to a real AdamW,
    the engine around it reduced to the three attributes the function reads): under ZeRO-3 each group gets
    its own weight decay back and its own step, the loaded learning rate stays; under ZeRO-1/2, whose load
    restores each group's own, nothing is touched. (End to end: test_sharded_states_resume_on_another_number_of_processes.)"""
    from types import SimpleNamespace

    from bert_recipes.backends.deepspeed_universal import loading_universal
    decay, no_decay = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    adam = torch.optim.AdamW([{"params": [decay], "weight_decay": 0.01}, {"params": [no_decay], "weight_decay": 0.0}],
                             lr=1e-3)
    (decay.sum() + no_decay.sum()).backward()
    adam.step()
    config = SimpleNamespace(load_universal_checkpoint=False)
    engine = SimpleNamespace(_config=config, optimizer=SimpleNamespace(param_groups=adam.param_groups, optimizer=adam),
                             zero_optimization_stage=lambda: stage)
    with loading_universal(engine):
        assert config.load_universal_checkpoint is True
        shared = torch.tensor(8.0)
        for group in adam.param_groups:   # the slips
            group.update(weight_decay=0.01, lr=5e-4)
            adam.state[group["params"][0]]["step"] = shared
    assert config.load_universal_checkpoint is False
    steps = [adam.state[p]["step"] for p in (decay, no_decay)]
    assert [g["lr"] for g in adam.param_groups] == [5e-4, 5e-4] and [float(s) for s in steps] == [8.0, 8.0]
    if stage == 3:
        assert [g["weight_decay"] for g in adam.param_groups] == [0.01, 0.0] and steps[0] is not steps[1]
    else:
        assert [g["weight_decay"] for g in adam.param_groups] == [0.01, 0.01] and steps[0] is steps[1]


def test_a_pipeline_stage_change_is_refused():
    """The pipeline's layouts: another number of replicas continues (test_pipeline_classification_and_data_parallel
    runs it), another number of stages is refused with both layouts named."""
    from bert_recipes.layout import resume_layout
    from bert_recipes.config import ConfigError
    layout = lambda world, replicas, accum: {"backend": "pipeline", "kind": "pipeline", "world": world,  # noqa: E731
                                             "replicas": replicas, "accum": accum, "micro_batch_size": 4}
    assert "x accum 4 x 1 replicas (was micro 4 x accum 2 x 2 replicas)" in resume_layout(
        layout(4, 2, 2), layout(2, 1, 4), Path("ckpt"))
    assert resume_layout(layout(4, 2, 2), layout(4, 2, 2), Path("ckpt")) is None   # the same layout: nothing to say
    for was, now in ((layout(4, 2, 2), layout(8, 2, 2)), (layout(8, 4, 1), layout(8, 2, 2))):   # more processes, or as many
        with pytest.raises(ConfigError) as refused:
            resume_layout(was, now, Path("ckpt"))
        stages = lambda world, replicas: f"{replicas} data-parallel replicas x {world // replicas} pipeline stages"  # noqa: E731
        assert (f"saved by {was['world']} processes under pipeline ({stages(was['world'], was['replicas'])}) and this "
                f"run has {now['world']} under pipeline ({stages(now['world'], now['replicas'])}): a stage's layers"
                in str(refused.value) and str(refused.value).endswith("set the DeepSpeed JSON's pipeline.stages back "
                                                                     "to 2")), refused.value
