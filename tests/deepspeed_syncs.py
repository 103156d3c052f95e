"""The host waits DeepSpeed's own optimizer step makes (DeepSpeed 0.19.8), each with the line that causes it: the
allowlist tests/test_backends.py holds logging.sync_audit's report to under the DeepSpeed rows (DDP and FSDP2 have
none). Test instrumentation: matched by DeepSpeed's files and functions, so it lives here, not in the package;
tests/test_internals.py checks that each named function is still where it is named.
"""
from __future__ import annotations

# The host waits DeepSpeed's own step makes, with the line that causes each (DeepSpeed 0.19.8): they are
# inside its optimizer step, which this repository does not change. Matched by file and function.
DEEPSPEED_SYNCS = {
    "deepspeed/runtime/utils.py is_invalid_grad_norm":
        "`bool((~torch.isfinite(norm) | (norm < 0)).any())` (runtime/utils.py:233): ZeRO-1/2's step "
        "(stage_1_and_2.py:3043) and its clipping (unscale_and_clip_grads, :3203), ZeRO-3's step (stage3.py:2888) "
        "skip a step whose gradient norm is not finite",
    "deepspeed/runtime/zero/stage_1_and_2.py complete_grad_norm_calculation_for_cpu_offload":
        "ZeRO-1/2 with offload_optimizer: each parameter's gradient norm read with .item() (:1929, :1949)",
    "deepspeed/runtime/zero/stage3.py complete_grad_norm_calculation_for_cpu_offload":
        "ZeRO-3 with offload_optimizer: the gradient norms read on the host (stage3.py:1989, :2003)",
    "deepspeed/runtime/zero/stage_1_and_2.py update_offload_overflow_tracker":
        "ZeRO-1/2 with offload_optimizer: an overflow flag read per parameter gradient (:1792)",
    "deepspeed/runtime/zero/utils.py get_lst_from_rank0":
        "ZeRO-3, first steps only: partitioned_param_coordinator.py's reset_step checks, until its parameter "
        "trace is complete, that every rank recorded the same module and parameter order (zero/utils.py:110)",
    "deepspeed/runtime/zero/utils.py <listcomp>": "the same check (the list comprehension inside get_lst_from_rank0)",
    "deepspeed/runtime/zero/utils.py assert_lst_len_same_as_other_ranks": "the same check (zero/utils.py:90)",
}


def allowed_deepspeed_sync(site: str) -> bool:
    file_and_function = site.split(" [")[0].split(" <- ")[0]
    file, function = file_and_function.split(":")[0], file_and_function.split(" ")[-1]
    return f"{file} {function}" in DEEPSPEED_SYNCS
