"""Host syncs in the step (logging.sync_audit, a documented user switch): every tensor call that makes the host
wait for a GPU, and every Python value written to the device, counted per call site between log steps
(SyncAudit). The loop reads it at log steps; tests/test_speed.py asserts the step has none."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# The tensor calls that make the host wait until a GPU has computed the value: reading it (item,
# tolist, bool/float/int of a tensor, formatting it, copying it to the host) or an output whose size
# depends on its values (nonzero, boolean-mask indexing, masked_select, unique).
SYNC_CALLS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "__repr__", "cpu",
              "numpy", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "repeat_interleave"}
# Call sites whose tensors are on the host in a GPU run too, so their calls wait for nothing: the
# collators (each task kind's class, named <...>Collator, and what they share: before the batch is copied to the
# device), torch's CPU optimizer kernels (host scalars such as the step count), the data loader, and the stop
# agreement's gloo tensor. Matched against "<file> <function's qualified name>".
HOST_SITES = ("bert_recipes/data/collate.py ", "Collator.", "bert_recipes/data/batching.py ", "torch/optim/", "torch/utils/data/", "bert_recipes/signals.py StopAgreement.")


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


_REPO = str(Path(__file__).resolve().parents[1]) + "/"


def _where(frame) -> str:
    name = frame.f_code.co_filename.replace(os.sep, "/").split("/site-packages/")[-1].removeprefix(_REPO)
    return f"{name}:{frame.f_lineno} {frame.f_code.co_name}"


def _site(frame) -> tuple[str, bool]:
    """(the first call site outside torch, as "file:line function", followed by its caller when both
    are in one library (DeepSpeed's helper and the step that called it); whether it is host-only work)."""
    host = False
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        host = host or any(part in f"{name} {frame.f_code.co_qualname}" for part in HOST_SITES)
        if "/torch/" not in name:
            site, caller = _where(frame), frame.f_back
            library = name.split("/site-packages/")[-1].split("/")[0] if "/site-packages/" in name else None
            if library and caller is not None and f"/site-packages/{library}/" in caller.f_code.co_filename:
                site += f" <- {_where(caller)}"
            return site, host
        frame = frame.f_back
    return "torch", host


# Python data written to the device: a tensor built there from Python values, or a copy onto it. On a
# GPU each is a pageable host-to-device copy that torch follows with a stream synchronize.
CREATIONS = {"tensor", "as_tensor", "scalar_tensor"}
TRANSFERS = {"to", "cuda", "copy_", "__setitem__"}


def _ours(site: str) -> bool:
    """A call site in the repository's own code (train.py, bert_recipes/), not a library's."""
    return site.startswith(("train.py:", "bert_recipes/"))


def _target(value) -> torch.device | None:
    """The device a `.to(...)` argument names (a device, a string, a CUDA index), or None."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        return torch.device(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


class _AuditMode(TorchFunctionMode):
    """SyncAudit's torch-function mode. One class for every audit and step: dynamo guards compiled code on the
    types in the torch-function mode stack, and a class made anew on each entry (as it once was) made every
    audited step of a compiled model recompile, until dynamo's recompile limit (8) sent training to eager in
    silence (tests/test_gpu_settings.py counts the recompiles)."""

    def __init__(self, audit: "SyncAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys
        audit, name, kwargs = self.audit, getattr(func, "__name__", ""), kwargs or {}
        if name in SYNC_CALLS or (name == "__getitem__" and _bool_index(args)) or \
                (name == "where" and len(args) == 1 and not kwargs):
            site, host = _site(sys._getframe(1))
            if not host:
                audit._count(f"{site} [{name}]")
        elif (name in CREATIONS or name in TRANSFERS) and audit.writes_to_device(name, args, kwargs):
            site, host = _site(sys._getframe(1))
            if not host and _ours(site):
                audit._count(f"{site} [{name}: host to device]")
        return func(*args, **kwargs)


class SyncAudit:
    """Counts, while it is entered, the calls that would make the host wait for a GPU, by call site:
    - reads (SYNC_CALLS, boolean-mask indexing) and torch.cuda / DeepSpeed `synchronize`;
    - writes from the repository's own code (train.py, bert_recipes/): a tensor built on the device
      from Python data (CREATIONS with a `device`), a copy onto the device (TRANSFERS). On a GPU a copy
      counts when its source is on the host; on a CPU everything is, so what counts is a call that names
      the device as its target (`.to(device)`, `.cuda()`): the call a GPU run would wait at. A copy_
      or an item assignment from a host tensor is seen on a GPU only (torch's sync debug mode, below).
    On a CPU the same calls return at once, but they are the same calls: a sync-free step on the CPU is
    a sync-free step on a GPU, and a call site named here is one a GPU run waits at. Host-only work
    (HOST_SITES) is left out, and so is the loader's own batch transfer (Accelerate's code). On a GPU
    it also turns on torch.cuda.set_sync_debug_mode("warn") while it is entered, with every warning
    shown (Python shows one a line by default), and counts torch's synchronization warnings."""

    def __init__(self, on_gpu: bool = False):
        from collections import Counter
        self.on_gpu = on_gpu       # the run's device (plan.on_gpu): torch's sync debug mode on top
        self.device_type = "cuda" if on_gpu else "cpu"
        self.sites = Counter()     # over the run
        self.window = 0            # since the last read_window()
        self.warnings = 0          # torch's sync warnings since the last read_warnings() (GPUs)
        self.mode = None
        self.patched = []
        self.caught = None

    def _count(self, site: str) -> None:
        self.sites[site] += 1
        self.window += 1

    def writes_to_device(self, name: str, args, kwargs) -> bool:
        """Does this call put Python data or a host tensor on the run's device? (see the class docstring)"""
        if name in CREATIONS:
            data = args[0] if args else kwargs.get("data")
            device = _target(kwargs.get("device"))
            if device is None:
                return False
            if isinstance(data, torch.Tensor):   # as_tensor of a tensor: a transfer
                return self._transfer(data, device, explicit=True)
            return device.type == self.device_type
        if name == "to":
            target, explicit = _target(kwargs.get("device")), "device" in kwargs
            for arg in args[1:]:
                if _target(arg) is not None:
                    target, explicit = _target(arg), True
                elif isinstance(arg, torch.Tensor):
                    target = arg.device
            return target is not None and self._transfer(args[0], target, explicit)
        if name == "cuda":
            return self._transfer(args[0], torch.device("cuda"), explicit=True)
        source = args[1] if len(args) > 1 else None   # copy_(dst, src), __setitem__(dst, index, value)
        source = args[2] if name == "__setitem__" and len(args) > 2 else source
        return isinstance(source, torch.Tensor) and self._transfer(source, args[0].device, explicit=False)

    def _transfer(self, source: torch.Tensor, target: torch.device, explicit: bool) -> bool:
        if target.type != self.device_type:
            return False
        return source.device.type == "cpu" if self.on_gpu else explicit

    def __enter__(self):
        self.mode = _AuditMode(self)
        self.mode.__enter__()
        self._patch_synchronize()
        if self.on_gpu:   # and torch's own report of what waits, every warning shown
            import warnings
            self.debug_mode = torch.cuda.get_sync_debug_mode()
            self.caught = warnings.catch_warnings(record=True)
            self.records = self.caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        if self.caught is not None:
            torch.cuda.set_sync_debug_mode(self.debug_mode)
            self.caught.__exit__(*exc)
            self.caught = None
            self._sort_warnings(self.records)
        for owner, attr, original in self.patched:
            setattr(owner, attr, original)
        self.patched = []
        return False

    def _sort_warnings(self, records) -> None:
        """Count torch's synchronization warnings; show the others as they would have been."""
        import warnings
        for w in records:
            if "synchroniz" in str(w.message):
                self.warnings += 1
                self.sites[f"{w.filename.split('/site-packages/')[-1]}:{w.lineno} [sync debug warning]"] += 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

    def _patch_synchronize(self):
        import sys
        targets = [(torch.cuda, "synchronize")]
        if "deepspeed" in sys.modules:   # DeepSpeed's accelerator (its throughput timer, its optimizer steps)
            from .backends.deepspeed import synchronize_owner
            targets.append(synchronize_owner())
        for owner, attr in targets:
            original = getattr(owner, attr)

            def counted(*args, _original=original, **kwargs):
                self._count(f"{_site(sys._getframe(1))[0]} [synchronize]")
                return _original(*args, **kwargs)
            setattr(owner, attr, counted)
            self.patched.append((owner, attr, original))

    def read_window(self) -> int:
        count, self.window = self.window, 0
        return count

    def read_warnings(self) -> int:
        """torch's synchronization warnings since the last read (0 on a CPU: no debug mode there)."""
        count, self.warnings = self.warnings, 0
        return count
