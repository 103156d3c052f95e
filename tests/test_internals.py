"""One test per row of docs/internals.md: each reliance on a library's private internals, checked for the behaviour
the package relies on (not only that the name exists). A failure names its row: read the row, then the library's
change. The pins (requirements.txt) hold these together; these tests say which reliance broke when a pin moves."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import REPO


def row(name: str, what: str) -> str:
    return f"docs/internals.md, row '{name}': {what}"


def tiny_step(optimizer_kwargs=None, scale=lambda loss: loss):
    """A linear model with gradients (of the loss as `scale` returns it), its fused AdamW (the recipe's default
    kernel) and a copy of its weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **(optimizer_kwargs or {"fused": True}))
    scale(model(torch.randn(5, 4)).square().sum()).backward()
    return model, optimizer, [p.detach().clone() for p in model.parameters()]


def unchanged(model, before) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ----------------------------------------------------------------------------- torch
def test_grad_scaler_per_optimizer_states():
    """optim.skip_update_if raises the scaler's found_inf_per_device in place: the scaler's step must then skip
    the update and its update() must back the scale off, as for an overflow it found itself."""
    from bert_recipes.optim import skip_update_if
    name = "GradScaler._per_optimizer_states"
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    model, optimizer, before = tiny_step(scale=scaler.scale)
    scaler.unscale_(optimizer)   # what Accelerate's clip_grad_norm_ does first under fp16
    assert skip_update_if(types.SimpleNamespace(optimizer=optimizer), scaler, torch.tensor(True)) is True
    scaler.step(optimizer)
    scaler.update()
    assert unchanged(model, before), row(name, "the scaler stepped although found_inf_per_device was raised")
    assert scaler.get_scale() == 8.0, row(name, f"the scale did not back off (now {scaler.get_scale()})")


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": False}])
def test_optimizer_found_inf_contract(kernel):
    """Without a scaler the engine sets `found_inf` on torch's fused AdamW (torch._fused_adamw_ reads it): a step
    with found_inf 1 changes neither the weights nor the step count, so the next real step equals a fresh one.
    A kernel without the contract (the plain for-loop AdamW) is asked on the host instead."""
    from bert_recipes.optim import skip_update_if
    name = "the optimizer's found_inf contract (torch._fused_adamw_)"
    model, optimizer, before = tiny_step(kernel)
    wrapped = types.SimpleNamespace(optimizer=optimizer)
    if not kernel.get("fused"):
        assert skip_update_if(wrapped, None, torch.tensor(True)) is False, row(name, "a kernel without found_inf "
                                                                              "was handed it")
        return
    assert skip_update_if(wrapped, None, torch.tensor(True)) is True, row(name, "the fused AdamW no longer says "
                                                                          "_step_supports_amp_scaling")
    optimizer.step()
    assert unchanged(model, before), row(name, "a step with found_inf=1 changed the weights")
    skip_update_if(wrapped, None, torch.tensor(False))
    optimizer.step()
    fresh_model, fresh, _ = tiny_step(kernel)
    fresh.step()
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        torch.testing.assert_close(p, q, msg=row(name, "the skipped step counted (bias correction a step ahead)"))


def test_sync_audit_call_sites_come_from_sys_getframe():
    """sync_audit.SyncAudit names each host wait by its caller's file and line (sys._getframe inside the mode)."""
    from bert_recipes.sync_audit import SyncAudit
    with SyncAudit(False) as audit:
        line = sys._getframe().f_lineno + 1
        torch.ones(2).sum().item()
    assert dict(audit.sites) == {f"tests/test_internals.py:{line} test_sync_audit_call_sites_come_from_sys_getframe"
                                 " [item]": 1}, row("sys._getframe", f"sites {dict(audit.sites)}")


def test_quick_exit_runs_the_exit_handlers(tmp_path):
    """cli.quick_exit runs atexit's handlers (atexit._run_exitfuncs) and skips the interpreter's teardown."""
    done = subprocess.run([sys.executable, "-c", "import atexit\natexit.register(print, 'handler ran')\n"
                           "from bert_recipes.cli import quick_exit\nquick_exit(3)"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3 and done.stdout.strip() == "handler ran", row(
        "atexit._run_exitfuncs", f"exit {done.returncode}, output {done.stdout!r} {done.stderr[-500:]!r}")


# ----------------------------------------------------------------------------- transformers
def tiny_bert(packed: bool):
    from transformers import BertConfig

    from bert_recipes.architectures.bert import RecipeBertForMaskedLM
    from bert_recipes.dropout import use_recipe_attention
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    config._attn_implementation = "sdpa"
    model = RecipeBertForMaskedLM(config)
    use_recipe_attention(model, packed)
    return model


def test_attn_implementation_selects_the_recipe_attention(monkeypatch):
    """dropout.use_recipe_attention sets config._attn_implementation to its registered name: transformers must
    then call that attention function (and that mask function) in the forward."""
    from bert_recipes import dropout
    name = "config._attn_implementation"
    calls = {"attention": 0, "mask": 0}
    attention, mask = dropout.attention, dropout.padding_mask

    def counted_attention(*args, **kwargs):
        calls["attention"] += 1
        return attention(*args, **kwargs)

    def counted_mask(*args, **kwargs):
        calls["mask"] += 1
        return mask(*args, **kwargs)
    monkeypatch.setattr(dropout, "attention", counted_attention)
    monkeypatch.setattr(dropout, "padding_mask", counted_mask)
    model = tiny_bert(packed=True)
    assert model.config._attn_implementation == dropout.ATTENTION, row(name, "not set to the recipe's attention")
    ids = torch.randint(50, (2, 8))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert calls == {"attention": 1, "mask": 1}, row(name, f"transformers called {calls} of the registered functions")


def test_sdpa_mask_keyword_arguments(monkeypatch):
    """dropout.padding_mask calls transformers' sdpa_mask with attention_mask, local_size and
    allow_is_bidirectional_skip=False: an all-ones padding mask is still built (skipping it would read the mask
    on the host), and no mask at all stays None."""
    from transformers.masking_utils import sdpa_mask

    from bert_recipes import dropout
    name = "transformers' sdpa_mask keyword arguments"
    seen, padding_mask = [], dropout.padding_mask

    def kept(*args, **kwargs):
        out = padding_mask(*args, **kwargs)
        seen.append((kwargs.get("attention_mask") is not None, out))
        return out
    monkeypatch.setattr(dropout, "padding_mask", kept)
    model = tiny_bert(packed=False)
    ids = torch.randint(50, (2, 8))
    model(input_ids=ids, attention_mask=torch.ones_like(ids))
    model(input_ids=ids)
    (had_mask, built), (had_none, none) = seen
    assert had_mask and isinstance(built, torch.Tensor) and built.shape[-2:] == (8, 8), row(name, f"got {built!r}")
    assert not had_none and none is None, row(name, f"a batch without a padding mask got {none!r}")
    skipped = sdpa_mask(2, q_length=8, kv_length=8, mask_function=lambda *a: True,
                        attention_mask=torch.ones(2, 8, dtype=torch.bool), allow_is_bidirectional_skip=True)
    assert skipped is None, row(name, "allow_is_bidirectional_skip no longer skips an all-ones mask: the keyword "
                                      "padding_mask turns off may have changed meaning")


# ----------------------------------------------------------------------------- datasets
def test_dataset_fingerprint_follows_the_data(tmp_path):
    """tokenizing and sources key their caches on Dataset._fingerprint: the same file loads with the same
    fingerprint in another load, and other content with another."""
    from datasets import load_dataset
    name = "datasets' Dataset._fingerprint"

    def fingerprint(where: str) -> str:
        path = tmp_path / where / "rows.jsonl"
        return load_dataset("json", data_files=str(path), cache_dir=str(tmp_path / "cache"), split="train")._fingerprint
    for where, text in (("a", '{"text": "a"}\n'), ("b", '{"text": "b"}\n')):
        (tmp_path / where).mkdir()
        (tmp_path / where / "rows.jsonl").write_text(text)
    one = fingerprint("a")
    assert fingerprint("a") == one, row(name, "the same file loaded twice changed fingerprint")
    assert fingerprint("b") != one, row(name, "other data kept the fingerprint")


# ----------------------------------------------------------------------------- DeepSpeed and py-cpuinfo
def test_ds_engine_config_load_universal_checkpoint():
    """deepspeed_universal.loading_universal switches engine._config.load_universal_checkpoint on around a load:
    DeepSpeedEngine.load_checkpoint must read it there (through load_universal_checkpoint())."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    name = "DeepSpeed engine._config.load_universal_checkpoint"
    for value in (True, False):
        engine = types.SimpleNamespace(_config=types.SimpleNamespace(load_universal_checkpoint=value))
        assert DeepSpeedEngine.load_universal_checkpoint(engine) is value, row(name, "the engine reads another field")
    source = inspect.getsource(DeepSpeedEngine.load_checkpoint) + inspect.getsource(DeepSpeedEngine._load_checkpoint)
    assert source.count("self.load_universal_checkpoint()") >= 2, row(name, "load_checkpoint no longer asks it")


def test_partitioning_init_set_dtype_is_patched_only_while_it_runs():
    """zero3_keeps_model_dtype replaces zero.Init._set_dtype(self, ds_config, dtype) while ZeRO-3 partitions: a
    given dtype is kept, and the original is back afterwards; Init.__init__ must still call _set_dtype."""
    import inspect

    from deepspeed.runtime.zero.partition_parameters import Init

    from bert_recipes.backends.deepspeed import zero3_keeps_model_dtype
    name = "zero.Init._set_dtype"
    original = Init._set_dtype
    assert any("self._set_dtype(" in inspect.getsource(cls.__init__) for cls in Init.__mro__[:-1]), row(
        name, "Init's construction no longer calls it")
    with zero3_keeps_model_dtype():
        probe = types.SimpleNamespace()
        Init._set_dtype(probe, None, torch.float32)
        assert probe.dtype == torch.float32, row(name, f"a given fp32 became {probe.dtype}")
    assert Init._set_dtype is original, row(name, "the original was not restored")


def test_cpuinfo_is_asked_once(monkeypatch):
    """backends.deepspeed.ask_cpuinfo_once caches py-cpuinfo's get_cpu_info: DeepSpeed's op builders must look it
    up on the module when they ask (cpu_arch, simd_width), so every later question is answered from the cache."""
    import cpuinfo
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    from bert_recipes.backends.deepspeed import ask_cpuinfo_once
    name = "py-cpuinfo's cache (ask_cpuinfo_once)"
    calls = []

    def fake():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"]}
    monkeypatch.setattr(cpuinfo, "get_cpu_info", fake)
    ask_cpuinfo_once()
    builder = CPUAdamBuilder()
    answers = [builder.cpu_arch(), builder.cpu_arch(), builder.simd_width()]
    assert len(calls) == 1, row(name, f"py-cpuinfo was asked {len(calls)} times for {answers}")
    assert cpuinfo.get_cpu_info() == fake(), row(name, "the cached answer differs")


def test_numa_is_asked_once(monkeypatch):
    """backends.deepspeed.ask_numa_once caches DeepSpeed's get_numa_cores: its CPU accelerator's device_count (asked
    by ZeRO-3 at every gradient bucket) starts `numactl --hardware` once per process, not once per question."""
    import subprocess

    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.utils import numa

    from bert_recipes.backends.deepspeed import ask_numa_once
    monkeypatch.setattr(numa, "get_numa_cores", numa.get_numa_cores)   # restored after, cache and all
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    started = []
    real = subprocess.check_output

    def counted(cmd, *args, **kwargs):
        started.append(cmd)
        return real(cmd, *args, **kwargs)
    monkeypatch.setattr(subprocess, "check_output", counted)
    accelerator = CPU_Accelerator()
    control = [accelerator.device_count(), accelerator.device_count()]
    assert len(started) == 2, row("numactl's cache (ask_numa_once)", f"the control started {started}")
    ask_numa_once()
    answers = [accelerator.device_count() for _ in range(3)]
    assert len(started) == 3 and answers == control + control[:1], row("numactl's cache (ask_numa_once)",
                                                                       f"{started} for {answers}")


def test_ds_sync_allowlist_names_existing_functions():
    """tests/deepspeed_syncs.py (test instrumentation) names DeepSpeed's files and functions: each must still be
    there, or the allowlist would let a moved wait pass under another name and fail on the new one."""
    import deepspeed
    from deepspeed_syncs import DEEPSPEED_SYNCS
    site_packages = Path(deepspeed.__file__).parents[1]
    for key in DEEPSPEED_SYNCS:
        file, function = key.split(" ")
        if function.startswith("<"):
            continue
        text = (site_packages / file).read_text()
        assert f"def {function}(" in text, row("DeepSpeed's host waits (tests/deepspeed_syncs.py)",
                                               f"{file} has no {function}")
