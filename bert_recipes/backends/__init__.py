"""The launch side, one file per concern (none imports torch at import time but accelerator.py):

- plan.py: what the launch files ask for (LaunchPlan, decided once: device, backend vocabulary) and the
  backend matrix (accelerate_configs/backends.tsv);
- consistency.py: the recipe against the launch, resolved once (resolve_run, check_consistency);
- deepspeed.py: every DeepSpeed-specific rule and workaround (the pipeline engine: bert_recipes/pipeline.py);
- fsdp.py: every FSDP-specific one;
- accelerator.py: the Accelerator built from a resolved plan, and what engaged.

Import from the file itself (`from bert_recipes.backends.plan import LaunchPlan`): this package file
imports nothing, so reading a plan never loads torch.
"""
