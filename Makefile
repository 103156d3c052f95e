# bert-recipes. `make demo` and `make test` set themselves up (.venv + requirements.txt).
# The demo and the tests run offline on the embedded sample built from Python's own docs; the training
# targets (make <mode>, make glue) reach the Hugging Face Hub for models and datasets, as a user's run must.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
ACCEL    := $(VENV)/bin/accelerate
NPROC    ?=
MACHINE_RANK ?= 0
RECIPE   ?= recipes/tiny-mlm.yaml
CONFIG   ?=
ARGS     ?=

# Offline only for what runs on the project's own data (the demo, the tests).
OFFLINE  := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# A user's mistake is one `config error:` line and exit code 2: what a plain process can check is
# checked before the launch, in the launch's environment (bert_recipes/preflight.py, the checks
# train.py itself starts with); what only a rank sees is its one line, and the wrapper drops the
# launcher's ChildFailedError report after it, keeping the rank's exit code (bert_recipes/launch.py).
PREFLIGHT = $(PY) -m bert_recipes.preflight
LAUNCH    = $(PY) -m bert_recipes.launch $(ACCEL) launch
# Where the demo writes its two runs; it starts over each time (run.overwrite), so it runs twice in a row.
RUNS     ?= runs
SAMPLE   ?= data/sample
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
# The launcher (torch's elastic agent) forwards these to the training processes, which then save a
# checkpoint and exit (SIGUSR1: SLURM's --signal=USR1@120; without it the launcher would just die).
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1

.PHONY: help setup demo test bench prepare glue downstream doctor env-check allreduce scaling memory gpu-check gpu-smoke print-config clean

help:  ## list the targets
	@grep -E '^[a-z0-9 -]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'
	@echo "parallelism targets (accelerate_configs/backends.tsv):"
	@$(MAKE) --no-print-directory modes

# requirements-references.txt: the tests' outside references, into .venv/references (not on sys.path, no
# dependencies: timm must stay unimportable, or accelerate's CLI imports it and fails without torchvision).
# --upgrade replaces what an earlier setup put there, so a second run (or a changed pin) is the same install.
# requirements-trackers.txt: the MLflow and W&B clients logging.trackers can name (41 packages, 196 MB, ~25 s), into .venv
# itself (train.py imports them); kept apart from requirements.txt, which a run without them does not need.
# requirements-tests.txt: the tests' MLflow tracking server, into .venv/mlflow-server (not on the runs' path: they keep
# the client), --no-deps (requirements-tests.txt says why).
$(VENV)/.installed: requirements.txt requirements-references.txt requirements-trackers.txt requirements-tests.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet -r requirements-trackers.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/references -r requirements-references.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/mlflow-server -r requirements-tests.txt
	touch $@

setup: $(VENV)/.installed  ## create .venv and install requirements.txt, requirements-trackers.txt (MLflow, W&B), requirements-references.txt and requirements-tests.txt (tests)

DEMO_MLM = --recipe recipes/tiny-mlm.yaml --run.output_dir=$(RUNS)/tiny-mlm --data.sample_dir=$(SAMPLE) \
	--run.overwrite=true --logging.progress_bar=false --checkpoint.downstream=recipes/tiny-classify.yaml $(ARGS)
DEMO_CLS = --recipe recipes/tiny-classify.yaml --run.output_dir=$(RUNS)/tiny-classify --data.sample_dir=$(SAMPLE) \
	--model.name_or_path=$(RUNS)/tiny-mlm/model --run.overwrite=true --logging.progress_bar=false $(ARGS)
DEMO_NPROC = --num_processes $(or $(NPROC),2)

demo: setup  ## pretrain a tiny BERT on 2 CPU processes, fine-tune it, print a summary (~10 min); starts over each time
	$(PY) -m bert_recipes.data.sample $(SAMPLE)
	@$(call col,ddp,4) $(PREFLIGHT) accelerate_configs/cpu.yaml $(DEMO_NPROC) -- $(DEMO_MLM)
	$(OFFLINE) $(call col,ddp,4) $(LAUNCH) --config_file accelerate_configs/cpu.yaml $(DEMO_NPROC) train.py $(DEMO_MLM)
	$(OFFLINE) $(call col,ddp,4) $(LAUNCH) --config_file accelerate_configs/cpu.yaml $(DEMO_NPROC) train.py $(DEMO_CLS)
	$(PY) -m bert_recipes.summary $(RUNS)/tiny-mlm $(RUNS)/tiny-classify

test: setup  ## run the test suite (CPU, offline)
	$(OFFLINE) $(PY) -m pytest tests -v -ra --durations=15

# ---------------------------------------------------------------- one target per parallelism mode
# make zero3 RECIPE=recipes/bert-base-mlm-phase1.yaml  on the GPUs in accelerate_configs/zero3.yaml
# make zero3 CPU=1                                     the same on 2 CPU processes (no GPU needed)
# NPROC=4 overrides the process count, CONFIG=... the accelerate config. The targets, their configs
# and the CPU launch rule are the rows of accelerate_configs/backends.tsv (tools/ and the tests read
# the same file): CPU=1 takes a row's cpu_config and prefixes its cpu_env.
BACKENDS := accelerate_configs/backends.tsv
MODES    := $(shell awk -F'\t' '!/^\#/ {print $$1}' $(BACKENDS))
MULTI_NODE_MODES  := $(shell awk -F'\t' '!/^\#/ && $$5 > 1 {print $$1}' $(BACKENDS))   # the nodes column
SINGLE_HOST_MODES := $(filter-out $(MULTI_NODE_MODES),$(MODES))
col       = $(shell awk -F'\t' '$$1=="$(1)" {print $$$(2)}' $(BACKENDS))
# Processes: NPROC if given, 2 with CPU=1, else one per GPU present (the YAMLs' num_processes: 8 is
# documentation; Accelerate would start 8 ranks on a 4-GPU host, and the extra ones die).
NPROC_ARG = $(if $(NPROC),--num_processes $(NPROC),$(if $(CPU),--num_processes 2,$(if $(filter-out 0,$(GPUS)),--num_processes $(GPUS))))
CPU_ENV   = $(if $(CPU),$(filter-out -,$(call col,$@,4)))
# On GPUs each rank is bound to the CPUs of its GPU's NUMA node (accelerate's ACCELERATE_CPU_AFFINITY: the YAML's
# enable_cpu_affinity key is ignored by accelerate 1.15's launcher), unless CUDA_VISIBLE_DEVICES selects GPUs
# accelerate would bind wrongly (tools/affinity.sh). AFFINITY=0 (or ACCELERATE_CPU_AFFINITY=0 in the
# environment, as slurm/launch.sh reads it) turns it off.
AFFINITY ?= $(or $(ACCELERATE_CPU_AFFINITY),$(shell tools/affinity.sh))
GPU_ENV   = $(if $(CPU),,ACCELERATE_CPU_AFFINITY=$(AFFINITY))
MODE_CONFIG = $(or $(CONFIG),$(if $(CPU),$(filter-out -,$(call col,$@,3))),$(call col,$@,2))

.PHONY: modes $(MODES)
modes:  ## list the parallelism targets: make <mode> [CPU=1] [RECIPE=...] [NPROC=n] [CONFIG=...]
	@awk -F'\t' '!/^\#/ {printf "  make %-18s %s\n", $$1, $$2}' $(BACKENDS)

# A row whose cpu_config is gpu-only (FSDP) has no CPU launch: CPU=1 is one line and exit 2.
GPU_ONLY_CHECK = $(if $(CPU),$(if $(filter gpu-only,$(call col,$@,3)),echo "config error: make $@ CPU=1: $@ runs on GPUs only (accelerate_configs/backends.tsv); on CPU processes use a DDP or ZeRO row (make modes)" >&2; exit 2,:),:)

$(SINGLE_HOST_MODES): setup
	@$(GPU_ONLY_CHECK)
	@$(CPU_ENV) $(PREFLIGHT) $(MODE_CONFIG) $(NPROC_ARG) -- --recipe $(RECIPE) $(ARGS)
	$(CPU_ENV) $(GPU_ENV) $(LAUNCH) --config_file $(MODE_CONFIG) $(NPROC_ARG) train.py --recipe $(RECIPE) $(ARGS)

# Multi-node rows (nodes > 1 in the table): on each node, make <row> MACHINE_RANK=<0|1> MAIN_IP=<main node ip> (or use
# slurm/, which fills these in from SLURM's variables). CPU=1 runs 2 "nodes" x 1 process on 127.0.0.1.
$(MULTI_NODE_MODES): setup
ifdef CPU
	@$(CPU_ENV) $(PREFLIGHT) $(MODE_CONFIG) --num_processes 2 -- --recipe $(RECIPE) $(ARGS)
	$(CPU_ENV) $(LAUNCH) --config_file $(MODE_CONFIG) --num_machines 2 --num_processes 2 \
		--machine_rank 1 --main_process_ip 127.0.0.1 --main_process_port 29533 train.py --recipe $(RECIPE) $(ARGS) & \
	node1=$$!; \
	$(CPU_ENV) $(LAUNCH) --config_file $(MODE_CONFIG) --num_machines 2 --num_processes 2 \
		--machine_rank 0 --main_process_ip 127.0.0.1 --main_process_port 29533 train.py --recipe $(RECIPE) $(ARGS); \
	status=$$?; wait $$node1 || status=$$?; exit $$status
else
	@$(PREFLIGHT) $(MODE_CONFIG) $(if $(NPROC),--num_processes $(NPROC)) -- --recipe $(RECIPE) $(ARGS)
	$(GPU_ENV) $(LAUNCH) --config_file $(MODE_CONFIG) --machine_rank $(MACHINE_RANK) \
		$(if $(MAIN_IP),--main_process_ip $(MAIN_IP)) $(if $(NPROC),--num_processes $(NPROC)) train.py --recipe $(RECIPE) $(ARGS)
endif

# ---------------------------------------------------------------- diagnostics (docs/troubleshooting.md: "When training is slow or hangs")
# The GPUs torch sees, counted once per make (a torch import, about 2 s) and only where an NVIDIA device or
# nvidia-smi is present: elsewhere 0 at once (CPU hosts: every `make <mode> -n` and CPU=1 line).
GPUS      = $(eval GPUS := $(if $(wildcard /dev/nvidia[0-9]*)$(shell command -v nvidia-smi 2>/dev/null),$\
	$(shell $(PY) -c "import torch; print(torch.cuda.device_count())" 2>/dev/null),0))$(GPUS)
DIAG_NPROC = $(or $(NPROC),$(if $(filter-out 0,$(GPUS)),$(GPUS),2))
DIAG_ENV   = $(if $(filter-out 0,$(GPUS)),,ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1)

doctor: setup  ## the node before a long run: driver, GPU count, PCIe, NVLink, clocks/throttle, ECC, RAM, cores, NUMA, disk, NCCL env, versions (RECIPE=, CONFIG=, ARGS=--json)
	$(PY) tools/doctor.py $(if $(filter-out file,$(origin RECIPE))$(CONFIG),--recipe $(RECIPE)) $(if $(CONFIG),--config $(CONFIG)) $(if $(NPROC),--nproc $(NPROC)) $(ARGS)

env-check: setup  ## versions, GPUs, topology, P2P matrix, NCCL variables, buildable DeepSpeed ops (ARGS=--json)
	$(PY) tools/env_check.py $(ARGS)

allreduce: setup  ## all-reduce bus bandwidth 8 B..1 GiB over NPROC ranks, checked against the link; hangs reported
	$(DIAG_ENV) $(VENV)/bin/torchrun --nproc_per_node $(DIAG_NPROC) tools/allreduce.py $(ARGS)

scaling: setup  ## throughput at 1, 2, 4 ... processes (ARGS="--backend zero2", "--cpu --size tiny"): table + PNG
	$(PY) tools/scaling.py $(ARGS)

memory: setup  ## will it fit? per-device memory of RECIPE for every backend + verdict (CONFIG=..., NPROC=8, ARGS="--gpu-memory 24")
	$(PY) tools/memory.py --recipe $(RECIPE) $(if $(CONFIG),--config $(CONFIG)) $(if $(NPROC),--world $(NPROC)) $(ARGS)

bench: setup  ## train.py vs transformers' Trainer on the same workload: tokens/s, ratios, MFU, memory, padding (ARGS="--size mini")
	$(OFFLINE) $(PY) tools/bench.py $(ARGS)

bench-data: setup  ## an MLM corpus prepared as a token store and through datasets, side by side (SIZE=256M|1G|4G, ARGS="--paths store")
	$(OFFLINE) $(PY) tools/bench_data.py --size $(or $(SIZE),256M) $(ARGS)

prepare: setup  ## tokenize RECIPE's corpus once into OUT (packed MLM: its run's token stores, WORKERS=N datatrove processes, then --data.cache_dir=OUT; the rest: then --data.source=prepared --data.prepared_dir=OUT; STORE=1: a token store of data.train_files, then --data.source=store --data.store_dir=OUT)
	$(PY) tools/prepare.py --recipe $(RECIPE) --out $(or $(OUT),data/prepared/$(basename $(notdir $(RECIPE)))) $(if $(STORE),--store) $(if $(WORKERS),--workers $(WORKERS)) $(ARGS)

downstream: setup  ## fine-tune and score every checkpoint export of RUN (pretrained with checkpoint.downstream): metrics.json, curves.png (CPU=1, CONFIG=, ARGS=)
	$(PY) tools/downstream.py $(or $(RUN),$(RUNS)/tiny-mlm) $(if $(CONFIG),--config $(CONFIG)) $(if $(CPU),--cpu) $(ARGS)

glue: setup  ## the nine GLUE tasks for MODEL (Hub name or dir; default bert-base-uncased): glue_results.md + submission/ (CONFIG=, CPU=1, ARGS="-- --train.epochs=1")
	$(PY) tools/glue.py --model $(or $(MODEL),bert-base-uncased) $(if $(CONFIG),--config $(CONFIG)) $(if $(CPU),--cpu) $(ARGS)

gpu-smoke: setup  ## one GPU, ~12 min: every one-node row (DDP x fp32/bf16/fp16, the rest bf16): eval, checkpoint, resume, export (ARGS="--matrix full")
	$(PY) tools/gpu_smoke.py $(ARGS)

gpu-check: setup  ## every backend row for a few steps on the GPUs present: steps/s, peak memory, loss (ARGS="--rows ddp,zero2")
	$(PY) tools/gpu_check.py $(ARGS)

print-config: setup  ## show the resolved config of RECIPE (with ARGS overrides)
	$(PY) train.py --recipe $(RECIPE) --print-config $(ARGS)

clean:  ## remove runs/ and the built sample (keeps .venv)
	rm -rf runs data/sample $(RUNS) $(SAMPLE)
