"""Reading the GPUs through NVML (NVIDIA's `nvidia-ml-py` bindings, imported as `pynvml`), as plain data.

NVML numbers the machine's GPUs in its own order and ignores CUDA_VISIBLE_DEVICES; torch's devices are
matched to NVML's by UUID. A reading a GPU does not support (NVML_ERROR_NOT_SUPPORTED) is recorded as
"not supported", never raised. Nothing here touches a CUDA stream except `burn`, the doctor's own load.
"""
from __future__ import annotations

import threading
import time

from .verdict import NOT_SUPPORTED


def _read(fn, *args):
    """fn(*args); "not supported" where NVML refuses the query on this GPU (not supported, no permission,
    not in this driver, an index past the GPU's links); "unreadable: <NVML's error>" for any other error
    (a GPU fallen off the bus, say), so one bad reading is a line of the report, not a crash."""
    import pynvml
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION,
                         pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
            return NOT_SUPPORTED
        return f"unreadable: {err}"


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def open_nvml() -> str | None:
    """Initialise NVML -> None, or why the GPUs cannot be read (no bindings, no driver)."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install -r requirements.txt)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"NVML cannot start ({err}): no NVIDIA driver loaded here"
    return None


def read_device(index: int, under_load: bool = False) -> dict:
    """One GPU's readings (NVML index)."""
    import pynvml as n
    h = n.nvmlDeviceGetHandleByIndex(index)
    bus = _text(n.nvmlDeviceGetPciInfo(h).busId)
    reading = {
        "index": index, "uuid": _text(n.nvmlDeviceGetUUID(h)), "name": _text(n.nvmlDeviceGetName(h)), "bus_id": bus,
        "numa_node": _read(n.nvmlDeviceGetNumaNodeId, h) if hasattr(n, "nvmlDeviceGetNumaNodeId") else NOT_SUPPORTED,
        "pcie": {"gen": _read(n.nvmlDeviceGetCurrPcieLinkGeneration, h),
                 "width": _read(n.nvmlDeviceGetCurrPcieLinkWidth, h),
                 "max_gen": _read(n.nvmlDeviceGetMaxPcieLinkGeneration, h),
                 "max_width": _read(n.nvmlDeviceGetMaxPcieLinkWidth, h),
                 "gpu_max_gen": _read(n.nvmlDeviceGetGpuMaxPcieLinkGeneration, h)},
        "sm_clock": _read(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
        "sm_clock_max": _read(n.nvmlDeviceGetMaxClockInfo, h, n.NVML_CLOCK_SM),
        "temperature": _read(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
        "throttle": _read(n.nvmlDeviceGetCurrentClocksEventReasons, h),
        "ecc_uncorrected": _read(n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                 n.NVML_VOLATILE_ECC),
        "under_load": under_load,
    }
    power, limit = _read(n.nvmlDeviceGetPowerUsage, h), _read(n.nvmlDeviceGetEnforcedPowerLimit, h)
    reading["power_w"] = power / 1000 if isinstance(power, int) else power          # NVML: milliwatts
    reading["power_limit_w"] = limit / 1000 if isinstance(limit, int) else limit
    rows = _read(n.nvmlDeviceGetRemappedRows, h)   # Ampere and later
    if not isinstance(rows, str):
        correctable, uncorrectable, pending, failure = rows
        reading["remapped"] = {"correctable": correctable, "uncorrectable": uncorrectable,
                               "pending": bool(pending), "failure": bool(failure)}
    else:   # older GPUs retire pages instead
        single = _read(n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        double = _read(n.nvmlDeviceGetRetiredPages, h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = _read(n.nvmlDeviceGetRetiredPagesPendingStatus, h)
        reading["retired"] = NOT_SUPPORTED if isinstance(single, str) or isinstance(double, str) else {
            "single_bit": len(single), "double_bit": len(double), "pending": pending == 1}
    active = 0
    for link in range(n.NVML_NVLINK_MAX_LINKS):
        state = _read(n.nvmlDeviceGetNvLinkState, h, link)
        if isinstance(state, str):   # past the GPU's last link, or no NVLink at all
            break
        active += state == n.NVML_FEATURE_ENABLED
    reading["nvlink_active"] = active
    return reading


def nvml_uuid(uuid: str) -> str:
    """torch's device UUID in NVML's spelling ("GPU-" in front), how the two are matched."""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def read_gpus(burn_s: float = 0.0) -> tuple[dict | None, str | None]:
    """-> (readings["gpu"], None), or (None, why not). With burn_s > 0 every GPU torch sees runs bf16 matmuls
    for that long and the link, clocks and throttle reasons are read near its end (an idle GPU lowers its
    PCIe generation and clocks)."""
    why = open_nvml()
    if why:
        return None, why
    import pynvml as n
    torch_gpus, peer = torch_devices()
    count = n.nvmlDeviceGetCount()
    load = burn(burn_s) if burn_s > 0 and torch_gpus else None
    gpus = [read_device(i, under_load=load is not None) for i in range(count)]
    if load is not None:
        load.finish(gpus, torch_gpus)
    gpu = {"driver": _text(n.nvmlSystemGetDriverVersion()), "cuda_driver": n.nvmlSystemGetCudaDriverVersion(),
           "count": count, "gpus": gpus, "torch": torch_gpus, "peer": peer}
    n.nvmlShutdown()
    return gpu, None


def torch_devices() -> tuple[list[dict], list[list[bool]]]:
    """The GPUs torch sees (its index, NVML's UUID format, name) and the P2P matrix among them."""
    import torch
    devices = []
    for i in range(torch.cuda.device_count()):   # 0 without a driver or a CUDA build
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", ""))
        devices.append({"index": i, "name": props.name, "uuid": nvml_uuid(uuid)})
    n = len(devices)
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return devices, peer


class burn:
    """Square bf16 matmuls on every GPU torch sees, in a thread, for `seconds`; `finish` waits for them
    and adds each GPU's TFLOP/s to its reading."""

    def __init__(self, seconds: float, size: int = 8192):
        import torch
        self.seconds, self.size, self.tflops = seconds, size, {}
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True)
                        for i in range(torch.cuda.device_count())]
        for t in self.threads:
            t.start()
        time.sleep(seconds * 0.8)   # read the GPUs near the end of the load

    def run(self, device: int) -> None:
        import torch
        g = torch.Generator(device=f"cuda:{device}").manual_seed(0)   # not the global stream (a seed fixes a run)
        a, b = (torch.randn(self.size, self.size, device=f"cuda:{device}", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        torch.cuda.synchronize(device)
        start, done = time.perf_counter(), 0
        while time.perf_counter() - start < self.seconds:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize(device)
            done += 10
        self.tflops[device] = 2 * self.size ** 3 * done / (time.perf_counter() - start) / 1e12

    def finish(self, gpus: list[dict], torch_gpus: list[dict]) -> None:
        for t in self.threads:
            t.join()
        by_uuid = {t["uuid"]: self.tflops.get(t["index"]) for t in torch_gpus}   # NVML's order may differ
        for g in gpus:
            if by_uuid.get(g["uuid"]) is not None:
                g["burn_tflops"] = round(by_uuid[g["uuid"]], 1)


class Sampler:
    """GPU busy share, memory busy share, SM clock, temperature and throttle reasons, sampled every
    `interval_s` in a background thread from a reader (`read(device) -> dict`), aggregated per window:
    `window()` returns and resets the aggregates. It never touches a CUDA stream, so it adds no host wait."""

    def __init__(self, read, device: int, interval_s: float = 0.5):
        self.read, self.device, self.interval_s = read, device, interval_s
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="gpu-sampler", daemon=True)

    def start(self) -> "Sampler":
        self.thread.start()
        return self

    def loop(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                row = self.read(self.device)
            except Exception:   # a reading that fails once must not end training
                continue
            with self.lock:
                self.rows.append(row)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2 * self.interval_s + 1)

    def window(self) -> dict | None:
        """Aggregates of the rows since the last call: mean and min busy %, mean memory busy %, max
        temperature, min SM clock, the throttle bits seen (OR-ed); None when no row came."""
        with self.lock:
            rows, self.rows = self.rows, []
        if not rows:
            return None
        busy = [r["busy"] for r in rows]
        bits = 0
        for r in rows:
            bits |= r.get("throttle") or 0
        return {"samples": len(rows), "busy_mean": round(sum(busy) / len(busy), 1), "busy_min": min(busy),
                "mem_busy_mean": round(sum(r["mem_busy"] for r in rows) / len(rows), 1),
                "temp_max": max(r["temperature"] for r in rows), "sm_clock_min": min(r["sm_clock"] for r in rows),
                "throttle": bits}


def nvml_sample(device_uuid: str):
    """A reader for Sampler: the GPU with this UUID (torch's device, matched in NVML). NVML must be open."""
    import pynvml as n
    handle = n.nvmlDeviceGetHandleByUUID(device_uuid)

    def read(_device: int) -> dict:
        rates = n.nvmlDeviceGetUtilizationRates(handle)
        return {"busy": rates.gpu, "mem_busy": rates.memory,
                "sm_clock": n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM),
                "temperature": n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU),
                "throttle": n.nvmlDeviceGetCurrentClocksEventReasons(handle)}
    return read


def start_sampler(device) -> tuple[Sampler | None, str | None]:
    """The GPU sampler of a training rank on `device` (torch's), matched to NVML by UUID -> (sampler, None),
    or (None, the one line saying why it does not run; training goes on without it)."""
    why = open_nvml()
    if why is None:
        try:
            import torch
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            return Sampler(nvml_sample(nvml_uuid(uuid)), device.index or 0).start(), None
        except Exception as err:   # noqa: BLE001 (a diagnostic: the run is the point)
            why = f"{type(err).__name__}: {str(err)[:120]}"
    return None, f"[gpu] logging.gpu_sampler: no GPU utilisation in the log lines ({why}); training goes on without it"
