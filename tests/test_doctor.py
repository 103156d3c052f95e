"""The node doctor (tools/doctor.py, bert_recipes/doctor/): on this CPU machine for real (no GPU, the real
/proc, /sys and disk, exit codes, --json, --record and --readings), and its GPU verdicts on device
readings given as data.

The device readings below are HAND-BUILT (no GPU has been lent to record real ones with --record yet):
each is a healthy H100-like node's reading, as NVML returns it (nvml.py), with one value changed."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bert_recipes.doctor import NOT_SUPPORTED, exit_code, judge   # noqa: E402
from bert_recipes.doctor.nvml import Sampler   # noqa: E402

GiB = 1024 ** 3


def by_name(checks, name):
    found = [c for c in checks if c.name == name]
    assert len(found) == 1, [c.name for c in checks]
    return found[0]


# ----------------------------------------------------------------------------- on this machine, for real
def test_doctor_on_a_cpu_machine_says_so_once_and_checks_the_real_host(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tools/doctor.py")], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    gpu = [line for line in lines if " gpu: " in line]
    assert len(gpu) == 1 and gpu[0].startswith("warn gpu: no GPU") and "GPU checks are skipped" in gpu[0]
    assert not any(re.match(r"\w+ (pcie|clocks|ecc) gpu", line) for line in lines)
    assert re.search(r"^ok   host ram: [\d.]+ GiB RAM", out.stdout, re.M)
    assert lines[-1].startswith("[doctor]") and "0 fail" in lines[-1]

    from doctor import main
    record = tmp_path / "node.json"
    assert main(["--burn", "0", "--record", str(record)]) == 0
    readings = json.loads(record.read_text())
    meminfo = dict(re.findall(r"^(\w+):\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M))
    assert readings["host"]["mem_total"] == int(meminfo["MemTotal"]) * 1024
    assert readings["host"]["cpus"] == len(os.sched_getaffinity(0))
    assert set(readings["host"]["numa_nodes"]) == {p.name[4:] for p in Path("/sys/devices/system/node").glob("node[0-9]*")}
    assert readings["gpu"] is None and readings["gpu_error"]
    assert readings["versions"]["torch"].startswith("2.") and readings["pins"]["torch"] == "2.13.0"


def test_exit_code_and_json_follow_the_verdicts(tmp_path, capsys):
    """More ranks than the cores this process may use is a fail with the numbers; --json carries the same."""
    from doctor import main
    cores = len(os.sched_getaffinity(0))
    ranks = cores * 4
    args = ["--burn", "0", "--recipe", "recipes/tiny-mlm.yaml", "--config", "accelerate_configs/cpu.yaml",
            "--nproc", str(ranks), f"--run.output_dir={tmp_path}/run"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert f"fail host cores: {cores} cores for this process; the run uses {ranks} = {ranks} ranks" in text
    assert re.search(rf"ok   disk: [\d.]+ GiB free at {tmp_path}/run", text)
    assert main(args + ["--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["exit_code"] == 1 and result["readings"]["run"]["ranks"] == ranks
    assert {c["status"] for c in result["checks"] if c["name"] == "host cores"} == {"fail"}
    assert not (tmp_path / "run").exists()   # the doctor writes nothing


def test_recorded_readings_are_judged_as_the_node_was(tmp_path, capsys):
    from doctor import main
    node = healthy()
    node["gpu"]["gpus"][3]["pcie"]["width"] = 8
    path = tmp_path / "node.json"
    path.write_text(json.dumps(node))
    assert main(["--readings", str(path)]) == 1
    out = capsys.readouterr().out
    assert "fail pcie gpu3: Gen5 x8 of Gen5 x16" in out and "expected x16" in out
    path.write_text("{not json")
    assert main(["--readings", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"doctor: cannot read --readings {path}")


# ----------------------------------------------------------------------------- the verdicts, on readings as data
def gpu(i: int) -> dict:
    """HAND-BUILT: one H100 SXM's NVML readings under the doctor's burn, healthy."""
    return {"index": i, "uuid": f"GPU-0000000{i}-aaaa", "name": "NVIDIA H100 80GB HBM3", "bus_id": f"00000000:{i + 1:02X}:00.0",
            "numa_node": 0 if i < 4 else 1, "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16, "gpu_max_gen": 5},
            "sm_clock": 1980, "sm_clock_max": 1980, "temperature": 61, "throttle": 0x0, "power_w": 620.0,
            "power_limit_w": 700.0, "ecc_uncorrected": 0,
            "remapped": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
            "nvlink_active": 18, "under_load": True, "burn_tflops": 610.0}


def healthy() -> dict:
    """HAND-BUILT: an 8-GPU node, 112 cores, 2 TB RAM, two NUMA nodes, affinity on, driver 580 for CUDA 13.0."""
    return {"schema": 1, "source": "hand-built for tests/test_doctor.py",
            "versions": {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.15.0", "datasets": "5.2.0",
                         "evaluate": "0.4.6", "tokenizers": "0.23.3", "deepspeed": "0.19.8", "torch_cuda": "13.0"},
            "pins": {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.15.0", "datasets": "5.2.0",
                     "evaluate": "0.4.6", "tokenizers": "0.23.3", "deepspeed": "0.19.8"},
            "env": {"ACCELERATE_CPU_AFFINITY": "1"},
            "host": {"cpus": 112, "cpu_count": 112, "mem_total": 2048 * GiB, "mem_available": 1900 * GiB,
                     "numa_nodes": {"0": "0-55", "1": "56-111"}, "process_bytes": 3 * GiB},
            "gpu": {"driver": "580.65.06", "cuda_driver": 13000, "count": 8, "gpus": [gpu(i) for i in range(8)],
                    "torch": [{"index": i, "uuid": f"GPU-0000000{i}-aaaa", "name": "NVIDIA H100 80GB HBM3"} for i in range(8)],
                    "peer": [[True] * 8 for _ in range(8)]},
            "run": {"ranks": 8, "workers": 6, "host_bytes_per_rank": 0, "output_dir": "/scratch/run", "disk_free": 900 * GiB,
                    "keep_last": 2, "checkpoint_bytes": 2 * GiB, "export_bytes": GiB // 2, "nodes": 1}}


def changed(path: str, value) -> dict:
    node = healthy()
    *parents, last = path.split(".")
    target = node
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = value
    return node


def test_a_healthy_node_passes_every_check():
    checks = judge(healthy())
    assert [c for c in checks if c.status != "ok"] == []
    assert exit_code(checks) == 0
    assert "nvidia-smi's 'CUDA Version' 13.0 is the newest CUDA this driver runs" in by_name(checks, "driver").measured


@pytest.mark.parametrize("path, value, name, status, says", [
    ("gpu.gpus.3.pcie.width", 8, "pcie gpu3", "fail", "Gen5 x8 of Gen5 x16, under load"),
    ("gpu.gpus.3.pcie.width", 4, "pcie gpu3", "fail", "x4 of Gen5 x16"),
    ("gpu.gpus.2.pcie.gen", 3, "pcie gpu2", "fail", "Gen3 x16 of Gen5 x16, under load"),
    ("gpu.gpus.2.pcie", {"gen": 3, "width": 16, "max_gen": 3, "max_width": 16, "gpu_max_gen": 5}, "pcie gpu2", "warn",
     "(the GPU alone: Gen5)"),
    ("gpu.gpus.1.pcie", {"gen": 1, "width": 16, "max_gen": 5, "max_width": 16, "gpu_max_gen": 5, }, "pcie gpu1", "fail",
     "Gen1 x16"),
    ("gpu.gpus.5.throttle", 0x40, "clocks gpu5", "fail", "hardware thermal slowdown"),
    ("gpu.gpus.5.throttle", 0x80, "clocks gpu5", "fail", "hardware power brake slowdown"),
    ("gpu.gpus.5.throttle", 0x20, "clocks gpu5", "warn", "software thermal slowdown"),
    ("gpu.gpus.5.throttle", 0x4, "clocks gpu5", "ok", "software power cap"),
    ("gpu.gpus.5.throttle", NOT_SUPPORTED, "clocks gpu5", "warn", "throttle reasons not supported"),
    ("gpu.driver", "535.104.05", "driver", "fail", "driver 535.104.05, torch built with CUDA 13.0"),
    ("gpu.driver", "580.20", "driver", "warn", "driver 580.20, torch built with CUDA 13.0; nvidia-smi's 'CUDA Version' 13.0 is the newest CUDA this driver runs, not an installed toolkit (minor-version compatibility)"),
    ("gpu.driver", "590.44.01", "driver", "ok", "driver 590.44.01"),
    ("gpu.gpus.6.ecc_uncorrected", 3, "ecc gpu6", "fail", "3 uncorrected errors"),
    ("gpu.gpus.6.remapped", {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}, "ecc gpu6",
     "warn", "a remapping pending"),
    ("gpu.gpus.6.remapped", {"correctable": 0, "uncorrectable": 9, "pending": False, "failure": True}, "ecc gpu6",
     "fail", "a remapping failed"),
    ("gpu.gpus.6.ecc_uncorrected", NOT_SUPPORTED, "ecc gpu6", "warn", "ECC not supported or off"),
    ("gpu.gpus.7.nvlink_active", 12, "topology", "warn", "18, 12"),
    ("gpu.gpus.7.burn_tflops", 300.0, "burn", "warn", "gpu7 300"),
    ("env", {"ACCELERATE_CPU_AFFINITY": "1", "NCCL_P2P_DISABLE": "1"}, "env NCCL_P2P_DISABLE", "fail", "NCCL_P2P_DISABLE=1"),
    ("env", {}, "numa", "warn", "2 NUMA node(s); gpu0 node 0"),
    ("versions.torch", "2.11.0+cu130", "version torch", "warn", "2.11.0+cu130"),
    ("versions.datasets", None, "version datasets", "fail", "not installed"),
    ("host.mem_total", 64 * GiB, "host ram", "fail", "64.0 GiB RAM"),
    ("run.workers", 20, "host cores", "warn", "the run uses 168 = 8 ranks x (20 workers + 1)"),
    ("run.disk_free", 5 * GiB, "disk", "fail", "the run writes up to 6.5 GiB = (2 kept + 1 being written) x 2.0 GiB"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_one_bad_reading_gives_its_verdict_with_the_numbers(path, value, name, status, says):
    checks = judge(changed(path, value))
    check = by_name(checks, name)
    assert (check.status, says in check.line()) == (status, True), check.line()
    assert [c.name for c in checks if c.status != "ok" and c.name != name] == []   # nothing else moved
    assert exit_code(checks) == (status == "fail")
    if status != "ok":
        assert check.fix, check


def test_minor_version_compatibility_and_the_gpu_count():
    node = changed("gpu.driver", "575.51.03")   # CUDA 13.0 wants 580; 12.x drivers don't run 13.x at all
    assert by_name(judge(node), "driver").status == "fail"
    node = changed("versions.torch_cuda", "12.8")
    node["gpu"]["driver"] = "550.54.14"          # >= 525: 12.x's minor-version compatibility, < 570.26
    check = by_name(judge(node), "driver")
    assert check.status == "warn" and "minor-version compatibility" in check.measured and ">= 570.26" in check.expected

    node = healthy()
    node["gpu"]["torch"] = node["gpu"]["torch"][:6]   # torch sees 6 of 8 with nothing selected: BIOS / driver
    check = by_name(judge(node), "gpu count")
    assert check.status == "fail" and "torch sees 6 of the machine's 8 GPUs" in check.measured and "Above 4G" in check.fix
    node["env"]["CUDA_VISIBLE_DEVICES"] = "2,3,4,5,6,7"   # ... or a selection: fine, but affinity binds by NVML index
    checks = judge(node)
    assert by_name(checks, "gpu count").status == "ok"
    numa = by_name(checks, "numa")
    assert numa.status == "warn" and "local rank i to the CPUs of the machine's GPU i" in numa.fix
    node["env"]["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"   # every GPU in NVML's order: affinity binds right
    assert by_name(judge(node), "numa").status == "ok"
    node = healthy()
    node["gpu"]["torch"][1]["name"] = "NVIDIA A100-SXM4-80GB"
    assert "mixed models" in by_name(judge(node), "gpu count").measured


def test_an_idle_read_and_unsupported_readings_are_warnings_not_crashes():
    node = healthy()
    for g in node["gpu"]["gpus"]:
        g.update(under_load=False, throttle=0x1, burn_tflops=None)
        g["pcie"]["gen"] = 1   # an idle GPU drops its link to Gen1
    checks = judge(node)
    pcie = by_name(checks, "pcie gpu0")
    assert pcie.status == "warn" and "an idle GPU lowers its link generation" in pcie.measured
    assert by_name(checks, "clocks gpu0").status == "ok"   # the idle bit is not a failure
    node = healthy()
    g = node["gpu"]["gpus"][0]
    g["pcie"] = dict.fromkeys(g["pcie"], NOT_SUPPORTED)
    g.update(sm_clock=NOT_SUPPORTED, temperature=NOT_SUPPORTED, power_w=NOT_SUPPORTED, nvlink_active=NOT_SUPPORTED)
    g.pop("remapped")
    g["retired"] = NOT_SUPPORTED
    checks = judge(node)
    assert by_name(checks, "pcie gpu0").status == "warn" and "not supported" in by_name(checks, "pcie gpu0").measured
    assert exit_code(checks) == 0
    g["throttle"] = g["ecc_uncorrected"] = "unreadable: GPU is lost"   # any other NVML error: a line, not a crash
    checks = judge(node)
    assert [by_name(checks, f"{k} gpu0").status for k in ("clocks", "ecc")] == ["warn", "warn"]
    assert "unreadable: GPU is lost" in by_name(checks, "ecc gpu0").measured
    node = copy.deepcopy(healthy())
    node["gpu"] = None
    node["gpu_error"] = "NVML cannot start"
    assert [c.line() for c in judge(node) if c.name == "gpu"][0].startswith("warn gpu: no GPU: NVML cannot start")


# ----------------------------------------------------------------------------- the utilisation sampler
def test_the_sampler_aggregates_each_window_and_stops():
    """A reader given as a function (on a GPU it is NVML's: nvml.nvml_sample); two windows of rows."""
    values = iter([(90, 0x0), (40, 0x4), (100, 0x40)] + [(80, 0x0)] * 1000)

    def read(device):
        busy, bits = next(values)
        return {"busy": busy, "mem_busy": busy // 2, "sm_clock": 1900 + busy, "temperature": 50 + busy // 10,
                "throttle": bits}

    sampler = Sampler(read, device=0, interval_s=0.01).start()
    deadline = time.time() + 5
    while len(sampler.rows) < 3 and time.time() < deadline:
        time.sleep(0.01)
    with sampler.lock:
        first = sampler.rows[:3]
        sampler.rows[:] = first
    window = sampler.window()
    assert window == {"samples": 3, "busy_mean": 76.7, "busy_min": 40, "mem_busy_mean": 38.3, "temp_max": 60,
                      "sm_clock_min": 1940, "throttle": 0x44}
    while not sampler.rows and time.time() < deadline:   # the next window's first rows
        time.sleep(0.01)
    sampler.stop()
    assert not sampler.thread.is_alive()
    second = sampler.window()
    assert second is not None and second["busy_min"] == 80
    assert sampler.window() is None   # stopped: no row comes any more


# ----------------------------------------------------------------------------- affinity
@pytest.mark.parametrize("visible, expected", [(None, "1"), ("0,1,2,3", "1"), ("4,5", "0"), ("0,2", "0"), ("", "0")])
def test_gpu_launches_bind_ranks_only_where_accelerate_binds_the_right_gpu(visible, expected):
    """accelerate binds local rank i to NVML's GPU i: right only when CUDA_VISIBLE_DEVICES is unset or 0..n-1.
    The Make targets (tools/affinity.sh) and the doctor's numa line apply the same rule. (That the ranks see
    the setting: tests/test_slurm.py, through slurm/launch.sh.)"""
    from bert_recipes.doctor.host import affinity_binds_own_gpu
    assert affinity_binds_own_gpu(visible) == (expected == "1")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_CPU_AFFINITY")}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    line = subprocess.run(["make", "-n", "zero2"], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    assert line.startswith(f"ACCELERATE_CPU_AFFINITY={expected} "), line
    for off in (["AFFINITY=0"], []):   # the Make variable, or the environment's setting (as slurm/launch.sh reads it)
        line = subprocess.run(["make", "-n", "zero2", *off], cwd=REPO, env={**env, "ACCELERATE_CPU_AFFINITY": "0"}
                              if not off else env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        assert line.startswith("ACCELERATE_CPU_AFFINITY=0 "), line


# ----------------------------------------------------------------------------- yardsticks
def test_scaling_is_judged_against_the_guides_figure_for_the_link():
    from bert_recipes.doctor.gpu import link_of, scaling_verdict
    node = healthy()
    assert link_of(node["gpu"]) == "nvlink"
    node["gpu"]["gpus"][2]["nvlink_active"] = 0
    assert link_of(node["gpu"]) == "pcie" and link_of(None) is None
    assert scaling_verdict(4, 0.90, "nvlink", []).startswith("4 GPUs over nvlink: 90%, within the band (the guides: 94%")
    low = scaling_verdict(4, 0.60, "pcie", ["fail pcie gpu3: Gen5 x8 of Gen5 x16"])
    assert "60%, below the band (68% and up; the guides: 78%)" in low and low.endswith("Gen5 x8 of Gen5 x16")
    assert "no yardstick for this count" in scaling_verdict(3, 0.8, "pcie", [])
    assert "input-bound ranks" in scaling_verdict(2, 0.5, "pcie", [])


def test_the_pipeline_bubble_and_the_accumulation_that_shrinks_it(capsys):
    from bert_recipes.memory import bubble_line
    assert bubble_line(2, 1).endswith("= 1/2 = 50% of each step idle; accumulation 3 or more (a smaller micro batch, "
                                      "same global batch) brings it under 25%")
    assert bubble_line(4, 16) == ("pipeline bubble: (stages - 1) / (micro batches + stages - 1) = 3/19 = 16% of "
                                  "each step idle")
    from memory import main
    assert main(["--recipe", "recipes/tiny-mlm.yaml", "--world", "2", "--gpu-memory", "24"]) == 0
    assert "pipeline bubble: (stages - 1) / (micro batches + stages - 1) = 1/" in capsys.readouterr().out
