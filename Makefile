# bert-recipes. `make demo` and `make test` set themselves up (.venv + requirements.txt).
# Everything runs offline: the demo and tests use the embedded sample built from Python's own docs.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
ACCEL    := $(VENV)/bin/accelerate
NPROC    ?= 2
RECIPE   ?= recipes/tiny-mlm.yaml
CONFIG   ?= accelerate_configs/cpu.yaml
ARGS     ?=

export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

.PHONY: help setup demo test ddp print-config clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

setup: $(VENV)/.installed  ## create .venv and install requirements.txt

demo: setup  ## pretrain a tiny BERT on 2 CPU processes, fine-tune it, print a summary (~10 min)
	$(PY) -m bert_recipes.sample data/sample
	ACCELERATE_USE_CPU=1 $(ACCEL) launch --config_file accelerate_configs/cpu.yaml --num_processes $(NPROC) \
		train.py --recipe recipes/tiny-mlm.yaml --logging.progress_bar=false $(ARGS)
	ACCELERATE_USE_CPU=1 $(ACCEL) launch --config_file accelerate_configs/cpu.yaml --num_processes $(NPROC) \
		train.py --recipe recipes/tiny-classify.yaml --logging.progress_bar=false $(ARGS)
	$(PY) -m bert_recipes.summary runs/tiny-mlm runs/tiny-classify

test: setup  ## run the test suite (CPU, offline)
	$(PY) -m pytest tests -v -ra --durations=15

ddp: setup  ## RECIPE on NPROC processes with DDP (CPU=1 ... is implied when no GPU: uses gloo)
	ACCELERATE_USE_CPU=$(if $(CPU),1,$(shell $(PY) -c "import torch;print(0 if torch.cuda.is_available() else 1)")) \
		$(ACCEL) launch --config_file $(CONFIG) --num_processes $(NPROC) train.py --recipe $(RECIPE) $(ARGS)

print-config: setup  ## show the resolved config of RECIPE (with ARGS overrides)
	$(PY) train.py --recipe $(RECIPE) --print-config $(ARGS)

clean:  ## remove runs/ and the built sample (keeps .venv)
	rm -rf runs data/sample
