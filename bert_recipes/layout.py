"""A run's layout over processes (backend, world, replicas, accumulation, micro batch), saved with each checkpoint,
and what a resume in another layout means: the state re-cut (one [resume] line), or refused in one line where it
cannot be re-cut (the pipeline's stages, another backend, NVMe-offloaded states)."""
from __future__ import annotations

from pathlib import Path

from .checkpoint import read_train_state
from .config import ConfigError


def run_layout(plan, micro_batch_size: int, negatives_in: int | None = None) -> dict:
    """How a run is laid out over processes, saved with each checkpoint (train_state.json) so a resume can
    tell what changed. negatives_in: retrieval with task.negatives=micro, the texts of a query's softmax (micro batch
    x processes), which the loss depends on."""
    layout = {"backend": plan.name, "kind": plan.kind, "world": plan.world, "replicas": plan.replicas,
              "accum": plan.accum, "micro_batch_size": micro_batch_size}
    return layout | ({"negatives_in": negatives_in} if negatives_in else {})


def saved_layout(checkpoint: Path) -> dict | None:
    """The layout a checkpoint was saved with; for one saved before layouts were recorded, the world size
    counted from Accelerate's per-process RNG files (None when neither is there)."""
    state = read_train_state(checkpoint)
    if "layout" in state:
        return state["layout"]
    worlds = len(list(Path(checkpoint).glob("random_states_*.pkl")))
    return {"world": worlds} if worlds else None


def resume_layout(saved: dict | None, now: dict, checkpoint: Path, key: str = "checkpoint.resume",
                  optimizer_state: bool = True) -> str | None:
    """A resume on another number of processes -> the [resume] line saying what follows from it (None: the
    same number). The global batch is the recipe's and the accumulation follows the world size; the micro
    batches' global order is a function of (run.seed, epoch), so step k trains on the same sequences. DDP's
    state is whole on every rank; ZeRO's partitions are re-cut through DeepSpeed's universal checkpoint
    (backends/deepspeed_universal.py); FSDP's shards through torch's distributed checkpoint, which Accelerate
    saves them with. What cannot be re-cut (reshard_refusal) is one line before any rank trains.
    A phase's start (key checkpoint.init_from) that takes the weights alone (not `optimizer_state`) reads them whole
    from any backend's checkpoint (backends/saved_weights.py): a line where the layout differs, never a refusal."""
    if not saved or saved.get("world") is None:
        return None
    was = saved["world"]
    if key != "checkpoint.resume" and not optimizer_state:
        if (was, saved.get("backend", now["backend"])) == (now["world"], now["backend"]):
            return None
        return (f"[init] {checkpoint} was saved by {was} processes under {saved.get('backend', now['backend'])}: its "
                f"full weights are read and this run's {now['backend']} lays them out on its {now['world']}")
    if saved.get("negatives_in") != now.get("negatives_in") and key == "checkpoint.resume":
        raise ConfigError(
            f"task.negatives=micro: {checkpoint} scored each query against the positives of {saved.get('negatives_in')} "
            f"pairs (micro batch x processes) and this run would against {now.get('negatives_in')}'s, another loss: "
            f"resume with {was} processes and micro batch {saved['micro_batch_size']}, or train with "
            "task.negatives=global (the same loss on any process count)")
    refusal = reshard_refusal(saved, now, checkpoint, key)
    if refusal:
        why, fix = refusal
        raise ConfigError(
            f"{key}: {checkpoint} was saved by {was} processes under {saved.get('backend', now['backend'])} "
            f"({stages(saved)}) and this run has {now['world']} under {now['backend']} ({stages(now)}): {why}; {fix}")
    if was == now["world"]:
        return None
    same_micro = saved.get("micro_batch_size") in (None, now["micro_batch_size"])
    order = ("step k trains on the same micro batches as before (their order is a function of run.seed and the "
             "epoch, not of the process count)" if same_micro else
             f"the micro batch changed ({saved['micro_batch_size']} -> {now['micro_batch_size']}), so the batches "
             "from here on differ from an uninterrupted run's")
    replicas = lambda layout: f"{layout.get('replicas') or layout['world']} replicas"   # noqa: E731 (= processes but under the pipeline)
    before = (f" (was micro {saved['micro_batch_size']} x accum {saved['accum']} x {replicas(saved)})"
              if "accum" in saved else "")
    universal = f"re-cut through DeepSpeed's universal checkpoint, made once in {checkpoint}/universal"
    recut = {"deepspeed": f"; ZeRO's partitions are {universal}",
             "pipeline": f"; the replicas' ZeRO-1 partitions are {universal}",
             "fsdp": "; FSDP's shards are re-cut by torch's distributed checkpoint on load"}.get(now["kind"], "")
    if key != "checkpoint.resume":   # a phase's start: its own batches from step 0; only the state is re-cut
        return (f"[init] {checkpoint} was saved by {was} processes, this run has {now['world']}" + recut.replace(
            "; ", ": ", 1) if recut else None)
    return (f"[resume] the world size changed, {was} -> {now['world']} processes: the global batch stays "
            f"micro {now['micro_batch_size']} x accum {now['accum']} x {replicas(now)}{before}; {order}; "
            "dropout and masks that do not depend on the example draw from per-rank streams, which differ" + recut)


def stages(layout: dict) -> str:
    """'<replicas> data-parallel replicas' (x '<stages> pipeline stages' under the pipeline)."""
    replicas = layout.get("replicas") or layout["world"]
    staged = f" x {layout['world'] // replicas} pipeline stages" if layout.get("kind") == "pipeline" else ""
    return f"{replicas} data-parallel replicas{staged}"


def reshard_refusal(saved: dict, now: dict, checkpoint: Path, key: str = "checkpoint.resume") -> tuple[str, str] | None:
    """Why a checkpoint cannot continue in this layout, and the fix (None: it can, re-cut where the process
    count changed). The pipeline's stage count and a phase's optimizer state under another backend are checked at
    any process count; the rest only when it changed."""
    same_world = f"resume on {saved['world']} processes (NPROC={saved['world']})"
    if saved.get("backend", now["backend"]) != now["backend"]:   # measured 2026-12-07: ZeRO-2 -> 2-offload or -> 3
        # fails inside DeepSpeed's load (KeyError, AssertionError), DDP -> ZeRO-2 too
        return ("an optimizer's state is carried over only under the backend that saved it",
                f"resume under {saved['backend']} (on any process count), or start a phase from its weights alone "
                f"under {now['backend']} (checkpoint.init_from={checkpoint})" if key == "checkpoint.resume" else
                "drop checkpoint.init_optimizer (the weights alone start under any backend and process count) or "
                f"start under {saved['backend']}")
    if now["kind"] == "pipeline" and saved.get("replicas") and saved["world"] // saved["replicas"] != now["world"] // now["replicas"]:
        return ("a stage's layers and their optimizer partitions are saved per stage, and only another number of "
                "replicas is re-cut", "set the DeepSpeed JSON's pipeline.stages back to "
                f"{saved['world'] // saved['replicas']}")
    if saved["world"] == now["world"]:
        return None
    if now["backend"].endswith("-nvme") or (Path(checkpoint) / "pytorch_model/offloaded_tensors").is_dir():
        return ("ZeRO's states offloaded to NVMe are not re-cut: DeepSpeed 0.19.8's universal checkpoint neither "
                "reads the optimizer's swap files (pytorch_model/offloaded_tensors) nor loads into parameters kept on "
                "NVMe", same_world)
    return None
