"""Throughput figures, MFU, the data-loader verdict and the profiler, in real single-process runs."""
from __future__ import annotations

import json
import time

import pytest
from transformers import BertConfig

from bert_recipes.throughput import flops_per_token, measured_cpu_peak
from conftest import run_in_process, tiny_args


def test_bert_base_flops_per_token_matches_the_6n_rule():
    """BERT-base at seq 128: 6 x (encoder matmul params) per token plus attention and head."""
    config = BertConfig()   # 768 hidden, 12 layers, 3072 MLP, 30522 vocab
    encoder_params = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    attention = 3 * 12 * 4 * 128 * 768
    head = 3 * 2 * (768 * 768 + 768 * 30522) * 0.15
    assert flops_per_token(config, 128, 0.15) == pytest.approx(6 * encoder_params + attention + head)
    assert flops_per_token(config, 512, None) > flops_per_token(config, 128, None)   # attention grows with seq


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = measured_cpu_peak(size=256, repeats=2)
    assert first > 1e8   # any CPU does more than 0.1 GFLOP/s
    assert json.loads((tmp_path / "bert-recipes/cpu_peak.json").read_text())
    assert measured_cpu_peak(size=256, repeats=2) == first   # read from the cache, not re-measured
    again = measured_cpu_peak(size=256, repeats=2, fresh=True)   # make bench's: measured in its own run
    assert measured_cpu_peak(size=256, repeats=2) == max(first, again)   # the cache keeps the best seen


@pytest.fixture
def slow_data(monkeypatch):
    """A dataset whose every item takes 40 ms (read one by one or a batch at once, as the DataLoader
    does): the model step of the tiny BERT is far shorter (a 4-step window waits 2.6 s for data)."""
    from bert_recipes.data import batching as data
    one, batch = data.Indexed.__getitem__, data.Indexed.__getitems__

    def slow_one(self, i):
        time.sleep(0.04)
        return one(self, i)

    def slow_batch(self, indices):
        time.sleep(0.04 * len(indices))
        return batch(self, indices)
    monkeypatch.setattr(data.Indexed, "__getitem__", slow_one)
    monkeypatch.setattr(data.Indexed, "__getitems__", slow_batch)


def _run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys, **extra):
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "logging.log_every": 4, **extra}))
    history = json.loads((tmp_path / "run/metrics.json").read_text())["history"]["train"]
    return metrics, history, capsys.readouterr().out


def test_slow_data_loader_is_called_out_once(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys,
                                             slow_data):
    _, history, out = _run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys)
    # every window mostly waits; 0.3, not 0.5: a CI host stalled for 7 s once in a window (2026-12-01)
    assert all(r["data_wait_share"] > 0.3 for r in history), [r["data_wait_share"] for r in history]
    assert out.count("the data loader is starving the model") == 1
    assert "raise data.num_workers" in out and "pre-tokenize" in out
    # one process: its wait is the worst rank's; a CPU run samples no GPU (logging.gpu_sampler is GPU-only)
    assert all(abs(r["data_wait_worst"] - r["data_wait_share"]) < 1e-6 for r in history), history
    assert not any("gpu_busy" in r for r in history) and "GPU busy" not in out


def test_fast_data_loader_stays_quiet_and_mfu_is_reported(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                         capsys):
    """The normal in-process collation against a model whose step is not trivially short: with
    the 32-wide test BERT (~30 ms steps) collation alone is ~20% of a step, a true verdict, so
    this uses hidden 256 and sequence 64 (still seconds). One thread: the collation is single-threaded
    Python, so the model's step must not shrink with the host's core count (a many-core host would
    shrink the step and not the collation, and the share would rise)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, history, out = _run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys, **{
            "model.hidden_size": 256, "model.intermediate_size": 1024, "model.num_attention_heads": 4,
            "data.max_seq_length": 64, "model.max_position_embeddings": 64})
    finally:
        torch.set_num_threads(threads)
    assert "starving" not in out
    assert all(r["data_wait_share"] < 0.2 for r in history), [r["data_wait_share"] for r in history]
    # MFU divides by a matmul peak measured once per machine and thread count; on this 2-vCPU host one
    # measured while the other hyperthread compiled came out 40% low (2026-12-01), and this model's small
    # matmuls can beat a 1024^3 one: the bound catches a wrong formula (10x), not a slow machine
    assert all(0 < r["mfu"] < 3 for r in history), [r["mfu"] for r in history]
    assert "[mfu]" in out and "MFU" in out


def test_profile_writes_a_trace_and_a_top10_table(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    _, _, out = _run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys, **{"logging.profile": True})
    assert "[profile] top 10 operators by self time" in out and "Self CPU" in out
    traces = list((tmp_path / "run/profile").glob("*.pt.trace.json*"))
    assert traces and traces[0].stat().st_size > 1000


# ----------------------------------------------------------------------------- host waits in the step
def _repository_code(source: str, name: str):
    """A function compiled as if it lived in bert_recipes/ (the audit counts writes from the repository's
    own code only, by the file its frame names)."""
    from conftest import REPO
    scope = {"torch": __import__("torch")}
    exec(compile(source, str(REPO / "bert_recipes" / "audited_here.py"), "exec"), scope)
    return scope[name]


def test_sync_audit_counts_python_data_written_to_the_device():
    """On a CPU run the device is the CPU: a tensor built there from Python data, and a copy that names
    the device, are the calls a GPU run would wait at (a pageable copy, then a stream synchronize).
    Reads are counted as before; dtype casts, a tensor built on the host and library code are not."""
    import torch

    from bert_recipes.sync_audit import SyncAudit
    writes = _repository_code(
        "def writes(x):\n"
        "    torch.as_tensor(False, dtype=torch.float64, device=x.device)\n"   # 1
        "    torch.tensor([1.0, 2.0], device='cpu')\n"                          # 2
        "    torch.scalar_tensor(3, device=x.device)\n"                          # 3
        "    x.to('cpu')\n"                                                      # 4
        "    x.to(device=x.device)\n"                                            # 5
        "    x.to(torch.float64); x.to(x); torch.tensor([1.0]); torch.zeros(2, device=x.device)\n"   # none
        "    torch.where(x > 0, 5, x); x.sum().item()\n", "writes")              # a read: 1
    x = torch.ones(3)
    with SyncAudit(on_gpu=False) as audit:
        writes(x)
        torch.as_tensor(False, device=x.device)   # this test's own code: not the repository's, not counted
    sites = dict(audit.sites)
    assert sum(n for s, n in sites.items() if "host to device" in s) == 5, sites
    assert sum(n for s, n in sites.items() if s.endswith("[item]")) == 1, sites
    assert all(s.startswith("bert_recipes/audited_here.py:") for s in sites), sites


@pytest.mark.parametrize("decided", ["device", "host"])
def test_step_guard_counts_without_a_wait_or_a_write(decided):
    """StepGuard.add neither reads the device nor writes Python values to it, whether the skip was decided
    on the device (a bool tensor: DDP, FSDP2) or on the host (DeepSpeed's own check: a bool and a norm
    that stay where they are). check() then reads: 2 skipped of 5, the streak, the last bad step, and
    train.max_bad_steps in a row stop the run."""
    import torch

    from bert_recipes.divergence import Diverged, StepGuard
    from bert_recipes.sync_audit import SyncAudit
    guard = StepGuard(max_bad_steps=3)
    outcomes = [(1.5, False), (float("inf"), True), (1.2, False), (1.1, False), (float("nan"), True)]
    with SyncAudit(on_gpu=False) as audit:
        for step, (loss, bad) in enumerate(outcomes, 1):
            norm = torch.tensor(float("nan") if bad else 0.5)
            skipped = torch.tensor(bad) if decided == "device" else bad
            guard.add(step, torch.tensor(loss), norm if decided == "device" else (None if bad else 0.5), skipped,
                      torch.tensor(False) if decided == "device" else False)
    assert dict(audit.sites) == {}, dict(audit.sites)
    note = guard.check(5, 1e-3)
    assert note.startswith("[skip] 2 updates skipped (steps 2-5; last: loss nan") and "(1 in a row;" in note, note
    assert guard.skipped_total == 2 and guard.last_good == (4, pytest.approx(1.1))
    for step in (6, 7):
        guard.add(step, torch.tensor(float("inf")), None, torch.tensor(True) if decided == "device" else True)
    with pytest.raises(Diverged, match="3 steps in a row had a non-finite loss"):
        guard.check(7, 1e-3)


@pytest.mark.parametrize("window", [64, 8])
def test_modernbert_flops_per_token_match_torch_flop_counter(window):
    """ModernBERT's MFU terms (bert_recipes/architectures/modernbert.py) against torch's FlopCounterMode over a real
    forward of a tiny ModernBERT (eager attention: its matmuls are counted whole), x3 for the backward. With a window
    under the sequence, the local layer's attention counts only the keys it sees: the counter, which sees the dense
    masked matmul, counts s keys, so the difference is exactly that layer's 4 x (s - (2 x reach + 1)) x h, x3."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from bert_recipes.config import ModelConfig, TaskConfig
    from bert_recipes.models import build_model, model_config
    seq, hidden = 32, 64
    cfg = ModelConfig(architecture="modernbert", hidden_size=hidden, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=96, max_position_embeddings=64, local_attention=window,
                      global_attn_every_n_layers=2, attn_implementation="eager")
    task = TaskConfig(kind="mlm")
    config = model_config(cfg, task, 500, 0)
    model = build_model(cfg, task, config=config).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(5, 500, (2, seq)))   # no labels: the head runs on every token
    counted = 3 * counter.get_total_flops() / (2 * seq)
    reach = config.sliding_window
    unseen = max(0, seq - (2 * reach + 1))                   # keys a local query does not see
    assert flops_per_token(config, seq, 1.0) == pytest.approx(counted - 3 * 4 * unseen * hidden)
    if window == 64:
        assert unseen == 0


def test_a_window_shorter_than_a_second_is_not_judged():
    """The data loader's verdict waits for a window of a second: a 3-step run of 11 ms steps is its first batches
    and the host's jitter (the demo's shrunk run warned once so); the same share over 2 s is called out."""
    from bert_recipes.throughput import DataLoaderWatch
    watch = DataLoaderWatch()
    assert watch.verdict(0.5, 3, 0.1) == (0.5, None)
    share, said = watch.verdict(0.5, 3, 2.0)
    assert share == 0.5 and said.startswith("[data] WARNING: the data loader is starving the model: 50% of the last 3")
