# Two commands do all set-up on a fresh machine:
#   make demo   - the main job on its embedded default (creates .venv and installs what it needs)
#   make test   - lint (ruff), then the test suite (CPU tests always; GPU tests where CUDA is present)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lowbit-installed

.PHONY: demo test gpu-check sm90-static info clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "CUDA GPU found: installing torch with CUDA"; $(PY) -m pip install -q "torch>=2.11"; \
	else \
	    echo "no CUDA GPU: installing the CPU build of torch"; \
	    $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"; \
	fi
	@$(PY) -m pip install -q -e ".[gpu,train,test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowbit demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 -W ignore::RuntimeWarning

info: $(STAMP)
	$(VENV)/bin/lowbit info

gpu-check:
	bash tools/gpu_check.sh

# The sm_90 SASS checks of the Gluon kernels (register, spill and barrier counts) hold for the Triton the kernels were
# measured with (3.6, the GPU machine's); elsewhere they only compile. A second venv with that Triton (compile-only,
# no GPU) runs them here.
T36 := .venv-t36
$(T36)/.ok:
	@test -x $(T36)/bin/python || $(PYTHON) -m venv $(T36)
	@$(T36)/bin/pip install -q "triton==3.6.0" "torch==2.13.0" numpy pytest
	@touch $@

sm90-static: $(T36)/.ok
	PYTHONPATH=src:tests $(T36)/bin/python -m pytest -q -p no:cacheprovider tests -k "sm90 or sass"

clean:
	rm -rf $(VENV) $(T36) report .pytest_cache
