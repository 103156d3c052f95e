"""The GPU checks: each a function of `readings["gpu"]` (see nvml.py for how it is read).

The failure stories they answer (docs/troubleshooting.md, "The node doctor"): a driver older than
torch's CUDA; GPUs the machine has and torch does not see; a card on a narrow or downtrained PCIe
link; an NVLink down; hardware thermal or power slowdown; memory with uncorrected ECC errors.
"""
from __future__ import annotations

from .verdict import NOT_SUPPORTED, Check, supported

# The driver each CUDA toolkit shipped with (Linux x86_64; NVIDIA's CUDA Toolkit release notes, table
# "CUDA Toolkit and Corresponding Driver Versions"), and the minimum driver of each major release under
# minor-version compatibility (NVIDIA's "CUDA Compatibility" guide: 11.x >= 450.80.02, 12.x >= 525,
# 13.x >= 580). Between the two a torch build runs, with a limited feature set (no PTX JIT of newer code).
TOOLKIT_DRIVER = {(11, 8): "520.61.05", (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03",
                  (12, 3): "545.23.06", (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03",
                  (12, 8): "570.26", (12, 9): "575.51.03", (13, 0): "580.65.06"}
MINOR_COMPAT_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580"}

# nvmlDeviceGetCurrentClocksEventReasons bits (nvml.h, nvmlClocksEventReason*).
THROTTLE_FAIL = {0x8: "hardware slowdown", 0x40: "hardware thermal slowdown",
                 0x80: "hardware power brake slowdown"}
THROTTLE_WARN = {0x20: "software thermal slowdown"}
THROTTLE_BENIGN = {0x1: "idle", 0x2: "application clocks setting", 0x4: "software power cap",
                   0x10: "sync boost", 0x100: "display clock setting"}

# Scaling of data-parallel BERT the field guides measured (docs/troubleshooting.md cites them):
# Scaling efficiency of data-parallel BERT in the field guides, by link and GPU count (speedup / GPUs).
GUIDE_EFFICIENCY = {"pcie": {2: 1.81 / 2, 4: 3.10 / 4}, "nvlink": {4: 3.76 / 4, 8: 7.8 / 8}}


def guide_scaling(link: str) -> str:
    """The guides' figures for a link, as the topology line quotes them: '2 GPUs 1.81x (90%), ...'."""
    return ", ".join(f"{n} GPUs {e * n:.2f}x ({e:.0%})" for n, e in GUIDE_EFFICIENCY[link].items())


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in str(text).split(".") if p.isdigit())


def gpu_checks(readings: dict) -> list[Check]:
    gpu = readings.get("gpu")
    if not gpu:
        why = (readings.get("gpu_error") or "no NVIDIA driver or GPU here")
        return [Check("gpu", "warn", f"no GPU: {why}; the GPU checks are skipped",
                      fix="on a GPU node, check `nvidia-smi`; on CPU, train with CPU=1 (docs/backends.md)")]
    checks = [driver_check(gpu, readings.get("versions", {}).get("torch_cuda")), count_check(gpu, readings)]
    for g in gpu["gpus"]:
        checks += [pcie_check(g), clocks_check(g), ecc_check(g)]
    checks.append(topology_check(gpu))
    burned = [g for g in gpu["gpus"] if g.get("burn_tflops")]
    if burned:
        checks.append(burn_check(burned))
    return checks


def burn_check(burned: list[dict]) -> Check:
    """The doctor's bf16 matmul burn: a GPU well below its peers is slow for a reason the other checks name."""
    rates = sorted(g["burn_tflops"] for g in burned)
    median = rates[len(rates) // 2]
    said = "bf16 matmul " + ", ".join(f"gpu{g['index']} {g['burn_tflops']:.0f}" for g in burned) + " TFLOP/s"
    slow = [g["index"] for g in burned if g["burn_tflops"] < 0.8 * median]
    if slow:
        return Check("burn", "warn", said, f">= {0.8 * median:.0f} (80% of the median)", f"gpu{slow} lag their "
                     "peers: read their clocks and throttle lines above; every step waits for the slowest rank")
    return Check("burn", "ok", said, "within 20% of each other")


def driver_check(gpu: dict, torch_cuda: str | None) -> Check:
    driver, cuda_max = gpu.get("driver"), gpu.get("cuda_driver")
    smi = (f"nvidia-smi's 'CUDA Version' {cuda_max // 1000}.{cuda_max % 1000 // 10} is the newest CUDA this "
           "driver runs, not an installed toolkit" if isinstance(cuda_max, int) else "")
    if not torch_cuda:
        return Check("driver", "warn", f"driver {driver}; torch is a CPU build (no CUDA)", "a CUDA build of torch",
                     "pip install torch==<pin> --index-url https://download.pytorch.org/whl/cu128 (README, On GPUs)")
    cuda = version(torch_cuda)[:2]
    minimum = MINOR_COMPAT_DRIVER.get(cuda[0])
    shipped = max((v for k, v in TOOLKIT_DRIVER.items() if k[0] == cuda[0] and k <= cuda), key=version, default=None)
    said = f"driver {driver}, torch built with CUDA {torch_cuda}" + (f"; {smi}" if smi else "")
    if minimum is None:
        return Check("driver", "warn", said, f"a driver for CUDA {torch_cuda}", "no table entry for this CUDA "
                     "release here: compare with NVIDIA's CUDA Toolkit release notes")
    if version(driver) < version(minimum):
        return Check("driver", "fail", said, f">= {minimum} for CUDA {cuda[0]}.x, {shipped} for {torch_cuda}",
                     f"install driver {shipped} or newer, or a torch built for an older CUDA; with this driver "
                     "CUDA fails to initialise ('driver version is insufficient')")
    if shipped and version(driver) < version(shipped):
        return Check("driver", "warn", said + " (minor-version compatibility)", f">= {shipped} for all of CUDA "
                     f"{torch_cuda}", f"runs with a limited feature set (no PTX JIT of newer code); driver {shipped} "
                     "or newer lifts it")
    return Check("driver", "ok", said, f">= {shipped or minimum}")


def count_check(gpu: dict, readings: dict) -> Check:
    """NVML's count (every GPU of the machine) against torch's (what CUDA_VISIBLE_DEVICES leaves), matched by UUID."""
    nvml, seen = gpu.get("count", len(gpu["gpus"])), gpu.get("torch", [])
    visible = readings.get("env", {}).get("CUDA_VISIBLE_DEVICES")
    selected = None if visible is None else len([v for v in visible.split(",") if v.strip()])
    uuids = {g.get("uuid") for g in gpu["gpus"]}
    unmatched = [t["index"] for t in seen if t.get("uuid") not in uuids]
    names = sorted({t.get("name") or "" for t in seen} or {g.get("name") for g in gpu["gpus"]})
    said = f"torch sees {len(seen)} of the machine's {nvml} GPUs" + (
        f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
    if selected is None and len(seen) < nvml:
        return Check("gpu count", "fail", said, f"{nvml}", "GPUs the driver lists are hidden from CUDA: check "
                     "BIOS 'Above 4G decoding' / Resizable BAR, `dmesg | grep NVRM`, and that no GPU is in a "
                     "failed state (nvidia-smi -q)")
    if selected is not None and len(seen) < min(selected, nvml):
        return Check("gpu count", "fail", said, f"{min(selected, nvml)} (as CUDA_VISIBLE_DEVICES selects)",
                     "an entry of CUDA_VISIBLE_DEVICES names no usable GPU: list indices or UUIDs from nvidia-smi -L")
    if unmatched:
        return Check("gpu count", "warn", said + f"; torch GPU(s) {unmatched} match no NVML UUID", "every GPU "
                     "matched", "torch and NVML disagree about the devices: a MIG or container setup? check nvidia-smi -L")
    if len(names) > 1:
        return Check("gpu count", "warn", said + f"; mixed models: {', '.join(names)}", "one model",
                     "the slowest GPU sets every step's pace: select one model with CUDA_VISIBLE_DEVICES")
    return Check("gpu count", "ok", said + (f", {names[0]}" if names and names[0] else ""), f"{len(seen)}")


def pcie_check(g: dict) -> Check:
    p, name = g.get("pcie") or {}, f"pcie gpu{g['index']}"
    gen, width, max_gen, max_width, gpu_gen = (p.get(k) for k in ("gen", "width", "max_gen", "max_width", "gpu_max_gen"))
    if not supported(gen, width, max_gen, max_width):
        why = next(v for v in (gen, width, max_gen, max_width) if not supported(v))
        return Check(name, "warn", f"PCIe link not readable (NVML: {why})",
                     fix="read it with `nvidia-smi -q -d PCIE` or `lspci -vv` (LnkSta)")
    said = f"Gen{gen} x{width} of Gen{max_gen} x{max_width}" + (
        f" (the GPU alone: Gen{gpu_gen})" if supported(gpu_gen) and gpu_gen != max_gen else "")
    under = "under load" if g.get("under_load") else "idle"
    if width < max_width:
        return Check(name, "fail", f"{said}, {under}", f"x{max_width}", "the link trained narrower than card and "
                     "slot allow: reseat the card, check its riser or cable, try another slot; a narrow link "
                     "divides host-to-device and PCIe all-reduce bandwidth")
    if gen < max_gen and g.get("under_load"):
        return Check(name, "fail", f"{said}, {under}", f"Gen{max_gen} under load", "the link downtrained: "
                     "check the riser or cable and the BIOS PCIe speed setting")
    if supported(gpu_gen) and max_gen < gpu_gen:
        return Check(name, "warn", f"{said}, {under}", f"Gen{gpu_gen} (the GPU's)", "the slot or platform caps "
                     "the link below the GPU: the BIOS PCIe generation setting, or a slot on an older root port")
    if max_width < 16:
        return Check(name, "warn", f"{said}, {under}", "x16", "the slot is narrower than x16: move the GPU to an "
                     "x16 slot if the board has one")
    if gen < max_gen:
        return Check(name, "warn", f"{said}, {under}: an idle GPU lowers its link generation", f"Gen{max_gen} "
                     "under load", "run the doctor with its burn (the default), which reads the link under load")
    return Check(name, "ok", f"{said}, {under}", f"Gen{max_gen} x{max_width}")


def clocks_check(g: dict) -> Check:
    name, bits = f"clocks gpu{g['index']}", g.get("throttle")
    sm, sm_max, temp = g.get("sm_clock"), g.get("sm_clock_max"), g.get("temperature")
    power, limit = g.get("power_w"), g.get("power_limit_w")
    said = ", ".join(filter(None, [f"SM {sm} of {sm_max} MHz" if supported(sm, sm_max) else None,
                                   f"{temp} C" if supported(temp) else None,
                                   f"{power:.0f} of {limit:.0f} W" if supported(power, limit) else None,
                                   "under load" if g.get("under_load") else "idle"]))
    if not supported(bits):
        return Check(name, "warn", f"{said}; throttle reasons {bits}", fix="watch `nvidia-smi -q -d "
                     "PERFORMANCE` during a run")
    hard = [text for bit, text in THROTTLE_FAIL.items() if bits & bit]
    soft = [text for bit, text in THROTTLE_WARN.items() if bits & bit]
    benign = [text for bit, text in THROTTLE_BENIGN.items() if bits & bit]
    reasons = f"; reasons: {', '.join(hard + soft + benign)}" if bits else "; no throttle reason"
    if hard:
        return Check(name, "fail", said + reasons, "no hardware slowdown", "the board slows the GPU itself: "
                     "check cooling (fans, airflow, inlet temperature) and the power supply and cables; the "
                     "guides saw steps/s halve (3 -> 1.5)")
    if soft:
        return Check(name, "warn", said + reasons, "no thermal slowdown", "the GPU is above its operating "
                     "temperature: check airflow and fan speeds")
    low = g.get("under_load") and supported(sm, sm_max) and sm_max and sm < 0.7 * sm_max and not bits & 0x4
    if low:
        return Check(name, "warn", said + reasons, f">= {int(0.7 * sm_max)} MHz under load", "the SM clock stays "
                     "low without a reason NVML names: check application clocks (nvidia-smi -q -d CLOCK)")
    return Check(name, "ok", said + reasons, "no hardware or thermal slowdown")


def ecc_check(g: dict) -> Check:
    name, errors, rows, pages = f"ecc gpu{g['index']}", g.get("ecc_uncorrected"), g.get("remapped"), g.get("retired")
    if not supported(errors):
        said = f"ECC {NOT_SUPPORTED} or off" if errors in (None, NOT_SUPPORTED) else f"ECC {errors}"
        return Check(name, "warn", f"{said}: memory errors go unseen", "ECC on",
                     "a data-centre GPU: `nvidia-smi -e 1` and a reboot; a consumer GPU has none")
    said = f"{errors} uncorrected errors since the driver loaded"
    if isinstance(rows, dict):
        said += f"; remapped rows: {rows['uncorrectable']} uncorrectable, {rows['correctable']} correctable"
        if rows.get("failure"):
            return Check(name, "fail", said + ", a remapping failed", "no failure", "the GPU needs service: "
                         "drain the node and report it")
        if rows.get("pending"):
            return Check(name, "warn", said + ", a remapping pending", "none pending", "reset the GPU "
                         "(nvidia-smi -r) or reboot, so the remapped row takes effect")
    elif isinstance(pages, dict):
        said += f"; retired pages: {pages['double_bit']} double-bit, {pages['single_bit']} single-bit"
        if pages.get("pending"):
            return Check(name, "warn", said + ", a retirement pending", "none pending", "reboot so the "
                         "retired page takes effect")
    if errors:
        return Check(name, "fail", said, "0", "a run on this GPU may compute garbage or crash: drain the node, "
                     "reset the GPU and report it if the count comes back")
    return Check(name, "ok", said, "0")


def topology_check(gpu: dict) -> Check:
    """NVLink per GPU and the P2P matrix, and what they mean for DDP and the pipeline."""
    links = [g.get("nvlink_active") for g in gpu["gpus"]]
    counts = [n for n in links if supported(n)]
    n = len(gpu["gpus"])
    peer = gpu.get("peer") or []
    missing = [(i, j) for i, row in enumerate(peer) for j, ok in enumerate(row) if i != j and not ok]
    said = f"NVLink active per GPU: {', '.join(str(x) for x in links)}"
    if missing:
        return Check("topology", "warn", said + f"; no P2P between {missing[:4]}", "P2P between every pair",
                     "all-reduce goes through host memory: check `nvidia-smi topo -m`, IOMMU/ACS settings, and "
                     "NCCL_P2P_LEVEL / NCCL_P2P_DISABLE")
    if counts and max(counts) > 0 and min(counts) < max(counts):
        return Check("topology", "warn", said, f"{max(counts)} on every GPU", "a link is down: `nvidia-smi nvlink "
                     "-s`; a GPU with fewer links slows every all-reduce it joins")
    if n == 1:
        return Check("topology", "ok", said + "; one GPU: nothing to all-reduce")
    if counts and min(counts) > 0:
        return Check("topology", "ok", said + f": DDP should scale as NVLink nodes do ({guide_scaling('nvlink')}); "
                     "pipeline stages talk over NVLink")
    return Check("topology", "ok", said + f": all-reduce over PCIe, expect {guide_scaling('pcie')}; the pipeline's "
                 "point-to-point sends cost less than DDP's all-reduce there")


BAND = 0.10   # below the guide's figure by more than this, something on the node is suspect


def link_of(gpu: dict | None) -> str | None:
    """"nvlink" when every GPU has an active NVLink, "pcie" otherwise; None without GPU readings."""
    if not gpu or not gpu.get("gpus"):
        return None
    links = [g.get("nvlink_active") for g in gpu["gpus"]]
    return "nvlink" if all(isinstance(n, int) and n > 0 for n in links) else "pcie"


def scaling_verdict(n: int, efficiency: float, link: str | None, suspects: list[str]) -> str:
    """make scaling's yardstick: the measured efficiency at n GPUs against the guides' figure for the link
    the doctor found, and, below the band, the likely causes (the doctor's non-ok GPU and NCCL lines)."""
    if n == 1:
        return "1 GPU: the baseline"
    guide = GUIDE_EFFICIENCY.get(link or "", {}).get(n)
    if guide is None:
        known = "; ".join(f"{k}: " + ", ".join(f"{m} GPUs {v:.0%}" for m, v in d.items())
                          for k, d in GUIDE_EFFICIENCY.items())
        return f"{n} GPUs over {link or 'an unknown link'}: {efficiency:.0%}, no yardstick for this count ({known})"
    low = guide - BAND
    if efficiency >= low:
        return (f"{n} GPUs over {link}: {efficiency:.0%}, within the band (the guides: {guide:.0%}; "
                f"below {low:.0%} is suspect)")
    causes = suspects or ["none the doctor sees on the node: look for input-bound ranks (the data-wait share "
                          "of the run's log lines) and at NCCL_DEBUG=INFO's transports"]
    return (f"{n} GPUs over {link}: {efficiency:.0%}, below the band ({low:.0%} and up; the guides: {guide:.0%}); "
            "likely causes: " + "; ".join(causes))
