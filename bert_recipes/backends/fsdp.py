"""Everything FSDP-specific: FSDP runs on GPUs only (accelerate_configs/backends.tsv: on CPU processes
Accelerate would run DDP under its name: REPLACED), as FSDP2 (accelerate_configs/fsdp.yaml: fsdp_version 2;
no FSDP1 config ships), whose parameters are DTensor shards (what a rank holds). The recipe's own rule for FSDP
(LAMB needs whole tensors) is in backends/consistency.py with ZeRO's."""
from __future__ import annotations


# An FSDP config that Accelerate ran as something else (on CPU processes: plain DDP; accelerator.check_engaged).
REPLACED = ("the accelerate config asks for FSDP but Accelerate runs {got}: this run would be DDP under the name "
            "FSDP. Refusing. FSDP is a GPU-only row of accelerate_configs/backends.tsv: use a GPU machine, or a "
            "DDP/DeepSpeed config on CPU")


def dtensor_numel(p) -> int | None:
    """FSDP2: the rank's shard of a DTensor parameter; None for any other parameter."""
    return p.to_local().numel() if hasattr(p, "to_local") else None


def describe_fsdp(accelerator) -> dict:
    return {"fsdp_version": accelerator.state.fsdp_plugin.fsdp_version}


def wrap_model_layers(plugin, model) -> None:
    """FSDP's unit is the model's encoder layer. The launch config names one (accelerate_configs/fsdp.yaml:
    BertLayer); where it names an encoder layer of bert_recipes/architectures/ and the model is of another of them,
    the model's own layer class takes its place (ModernBertEncoderLayer), so the config runs every architecture
    unchanged. A config naming classes of its own keeps them."""
    from ..architectures import ARCHITECTURES, of_config
    layers = {row.layer_class for row in ARCHITECTURES.values()}
    own = ARCHITECTURES[of_config(model.config)].layer_class
    names = plugin.transformer_cls_names_to_wrap
    if names and set(names) <= layers:
        plugin.transformer_cls_names_to_wrap = [own]
