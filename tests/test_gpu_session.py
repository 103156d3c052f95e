"""The GPU session (tools/gpu_session.sh), rehearsed on CPU processes at tiny size: the same steps in the
same order, the same files, so it cannot rot between the days a GPU is at hand. On the GPU machine each
part is one command of at most 300 s that returns at most 8 files, no folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

PART_S = 300


def test_the_rehearsal_writes_what_the_gpu_session_returns(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tools/gpu_session.sh", "--rehearse", "all"], cwd=REPO, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "OUT": str(out), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    sessions = {}
    for part in ("must", "rest", "docs", "modern"):
        files = sorted(p for p in (out / part).rglob("*") if p.is_file())
        assert len(files) <= 8 and all(p.parent == out / part for p in files), files   # $OUT/<file> on the GPU
        session = sessions[part] = json.loads((out / part / "session.json").read_text())
        assert session["rehearsal"] is True and session["limit_sum_s"] <= PART_S, session["plan"]
        assert sum(step["limit_s"] for step in session["plan"]) == session["limit_sum_s"]
        statuses = [s["status"] for s in session["steps"]]
        if part == "docs":   # its second bench step runs the same rows at 1,024 tokens: on the GPU only
            assert statuses[:2] == ["ok", "ok"] and statuses[2].startswith("skipped in the rehearsal"), statuses
        else:
            assert statuses == ["ok"] * {"must": 4, "rest": 3, "modern": 2}[part], session["steps"]
        assert session["versions"]["torch"].startswith("2.13") and "deepspeed" in session["versions"]
        text = (out / part / "session.md").read_text()
        assert "| goal (one H200) |" in text and "not measured" in text   # the GPU-only figures say so
    must, rest = sessions["must"]["figures"], sessions["rest"]["figures"]
    for part in ("must", "rest"):   # the bench's quality check (6+ runs) stays out of a 300 s part
        assert "quality" not in json.loads((out / part / "bench.json").read_text()), part
    rows = must["bench_rows"]
    assert set(rows) == {"mlm: train.py, auto micro batch", "mlm: train.py + compile, auto micro batch",
                         "mlm: Trainer, same micro batch", "mlm: Trainer + compile, same micro batch"}, rows
    assert all(r["sequences_per_s"] > 0 and 0 <= r["data_wait"] < 1 and (r["launch_s"] is None or r["launch_s"] > 0)
               for r in rows.values())
    assert len(must["ratios"]) == 2 and must["auto"]["over_eager_trainer"] > 0
    doctor = json.loads((out / "must/doctor.json").read_text())   # make doctor: on CPU its one no-GPU line
    assert must["doctor"]["exit_code"] == doctor["exit_code"] == 0 and doctor["readings"]["host"]["cpus"] >= 1
    assert [c["name"] for c in doctor["checks"] if c["status"] != "ok"] == ["gpu"], doctor["checks"]
    assert "Self CPU" in (out / "must/profile.md").read_text()   # the eager row's warmup steps, profiled
    assert must["sync"]["processes"] == 2 and must["sync"]["host_waits_per_window"] == [0, 0, 0], must["sync"]
    assert "host_syncs" in (out / "must/sync_debug.log").read_text() or (out / "must/sync_debug.log").stat().st_size
    tuned = rest["bench_rows"]["classify: train.py, step times"]
    assert tuned["step_ms_median"] > 0 and tuned["step_max_over_median"] >= 1 and tuned["shapes"] >= 1
    assert set(rest["ratios"]) == {"mlm: train.py / mlm: Trainer", "mlm: train.py, dense head (equal work) / mlm: Trainer"}
    docs = sessions["docs"]["figures"]["by_size"]["tiny"]   # the documents part: its four rows and two ratios
    assert len(docs["bench_rows"]) == 4 and all(r["tokens_per_s"] > 0 for r in docs["bench_rows"].values()), docs
    assert set(docs["ratios"]) == {"mlm: packed, documents apart (varlen) / mlm: packed, documents apart (block mask)",
                                   "mlm: a document a row, unpadded (varlen) / mlm: a document a row, padded"}
    assert docs["bench_rows"]["mlm: a document a row, unpadded (varlen)"]["padding"] == 0
    assert (out / "docs/bench-tiny.md").exists()
    modern = sessions["modern"]["figures"]["by_size"]["tiny"]   # ModernBERT-base's row beside BERT-base's
    assert set(modern["ratios"]) == {"mlm: ModernBERT-base, StableAdamW, documents apart / mlm: BERT-base, documents apart"}
    row_ = modern["bench_rows"]["mlm: ModernBERT-base, StableAdamW, documents apart"]
    assert row_["sequences_per_s"] > 0 and row_["mfu_ours"] > 0 and row_["predicted_peak_mb"] > 0, row_
    smoke = (out / "rest/smoke.md").read_text()
    row = next(line for line in smoke.splitlines() if line.startswith("| ddp/bf16 |"))
    assert row.endswith("| ok |") and "| 2 |" in row and "n/a (CPU)" in row, row   # halted, resumed, exported
    for name in ("ddp/fp16", "fsdp/bf16"):
        assert f"| {name} | | | | | | | skipped: GPU only |" in smoke, smoke
