# labkit: the commands the README names. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# Where there is no GPU: the CPU build of torch (from local disk on this project's build machines;
# elsewhere add e.g. PIP_EXTRA_INDEX_URL pointing at PyTorch's CPU wheel index) and the Triton
# release the GPU image runs, for its interpreter, with a NumPy that interpreter works with
# (Triton 3.6's interpreter calls int() on one-element arrays, which NumPy 2.4 refuses).
TORCH_CPU ?= torch==2.13.0
TRITON_CPU ?= triton==3.6.0
NUMPY_CPU ?= numpy<2.4
# On a GPU host without a venv (an offline workshop node), gpu-check and record use $(PYTHON).
GPY = $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))
# e.g. GPU_CHECK_ARGS="--notebooks 00 01 --benchmarks launch_overhead" to check a part
GPU_CHECK_ARGS ?=
# e.g. FROM=gpu-results/<stamp>/notebooks: make handouts from notebooks already run (default: run them now)
FROM ?=
STAMP := $(shell date +%Y%m%d-%H%M%S)

.PHONY: help lab hub test run gpu-check record handouts reset venv clean chromium proxy student instructor nbgrader
help:
	@echo "make lab        set up .venv and open JupyterLab on notebooks/ (127.0.0.1, with a token)"
	@echo "                STUDENT=1: on the student copy in student/ instead (solutions as stubs)"
	@echo "make hub        JupyterHub for many learners: own lab, student copy and GPU/MIG slice each"
	@echo "                (127.0.0.1:8000; HUB_IP=0.0.0.0 only behind TLS; HUB_CONFIG=your config file)"
	@echo "make proxy      install configurable-http-proxy (npm, pinned) into hub/node_modules (make hub does)"
	@echo "make test       set up .venv if needed and run every test, notebooks included"
	@echo "make run        execute every notebook headless into runs/<timestamp>/ with a summary"
	@echo "make gpu-check  on a CUDA host: GPU tests, benchmarks, notebooks at full size -> gpu-results/"
	@echo "make record     on a CUDA host: refresh the recorded GPU figures in labkit/recorded_data/"
	@echo "make handouts   executed notebooks -> static HTML pages in handouts/<timestamp>/ (FROM=run folder)"
	@echo "make reset      strip outputs and widget state from notebooks/ (between workshop groups)"
	@echo "make student    student copies (each marked solution replaced by its stub) -> student/"
	@echo "make instructor the same files with the solutions kept -> instructor/"
	@echo "make nbgrader   the exercises as an nbgrader course -> course/ (then nbgrader generate_assignment, autograde)"
	@echo "                (whole notebooks, graded on a GPU; EXERCISES_ONLY=1: what the exercises need, on a CPU)"

venv: $(VENV)/.installed

# rfc3987-syntax comes with jupyter's jsonschema[format-nongpl] and builds an IRI grammar when
# jsonschema is imported, about 2 s in every notebook kernel (plotly imports nbformat, which
# imports jsonschema); nothing here validates IRIs, and jsonschema runs without it.
$(VENV)/.installed: pyproject.toml
	@set -e; \
	if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  echo "labkit: CUDA torch found in $(PYTHON): the venv uses it as it is"; \
	  [ -x $(VPY) ] || $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  if nvidia-smi -L >/dev/null 2>&1; then \
	    echo "labkit: this host has a GPU but $(PYTHON) has no CUDA build of torch."; \
	    echo "  Install one into $(PYTHON) first, or point make at a Python that has it: make lab PYTHON=/path/to/python"; \
	    exit 1; \
	  fi; \
	  echo "labkit: no GPU here: installing the CPU build ($(TORCH_CPU)) and Triton for its interpreter"; \
	  [ -x $(VPY) ] || $(PYTHON) -m venv $(VENV); \
	  $(VPY) -m pip install -q --disable-pip-version-check $(TORCH_CPU) $(TRITON_CPU) '$(NUMPY_CPU)'; \
	fi; \
	$(VPY) -m pip install -q --disable-pip-version-check -e '.[lab,test,hub]'; \
	$(VPY) -m pip uninstall -q -y rfc3987-syntax 2>/dev/null || true; \
	$(VPY) -m ipykernel install --sys-prefix --name labkit --display-name "labkit (.venv)" >/dev/null; \
	touch $@

# STUDENT=1: serve the student copy in student/ (written first if there is none; kept after)
STUDENT ?=
lab: venv
	$(VPY) -m labkit.tools.lab_server$(if $(STUDENT), --student student)

# A workshop's hub (README: "Running a workshop: many learners"). PAM sign-in and one OS account
# per learner need root; HUB_CONFIG names a JupyterHub config file (authenticator, devices).
HUB_IP ?= 127.0.0.1
HUB_PORT ?= 8000
HUB_CONFIG ?=
hub: venv proxy
	$(VPY) -m labkit.tools.hub --ip $(HUB_IP) --port $(HUB_PORT)$(if $(HUB_CONFIG), --config $(HUB_CONFIG))

# JupyterHub's configurable-http-proxy, from the npm registry at the versions hub/package-lock.json
# pins, into hub/node_modules (nothing is fetched when the hub runs). Needs node >= 20 and npm.
PROXY_STAMP := hub/node_modules/.installed
proxy: $(PROXY_STAMP)
$(PROXY_STAMP): hub/package.json hub/package-lock.json
	@command -v npm >/dev/null || { echo "labkit: installing configurable-http-proxy needs node >= 20 and npm" \
	  "(e.g. apt-get install nodejs npm)"; exit 1; }
	cd hub && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The hub test needs the proxy: when it cannot be installed, the test fails and says why.
test: venv chromium
	@$(MAKE) --no-print-directory proxy || echo "labkit: could not install configurable-http-proxy; the hub test will say so"
	$(VPY) -m pytest

# The browser test drives Debian's chromium (no browser download); installed here when missing.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  echo "labkit: installing chromium (apt) for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	  || echo "labkit: could not install chromium; the browser test will say so"; }
	@# the claims' held / not-held marks are emoji: without a font for them the screenshots show boxes
	@fc-list 2>/dev/null | grep -qi "color emoji" || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq fonts-noto-color-emoji >/dev/null \
	  || echo "labkit: could not install an emoji font; screenshots will show boxes for the marks"; }

run: venv
	$(VPY) -m labkit.tools.run_notebooks --out runs/$(STAMP)

gpu-check:
	$(GPY) -m labkit.tools.gpu_check --out gpu-results/$(STAMP) $(GPU_CHECK_ARGS)

record:
	$(GPY) -m labkit.tools.record

handouts:
	$(GPY) -m labkit.tools.handouts --out handouts/$(STAMP) $(if $(FROM),--from $(FROM))

student:
	$(GPY) -m labkit.tools.student --out student

instructor:
	$(GPY) -m labkit.tools.student --instructor --out instructor

# nbgrader's course folder: source/ rewritten from notebooks/; gradebook, submissions and grades kept.
# Whole notebooks, graded on a GPU host; EXERCISES_ONLY=1: what the exercises need, graded on a CPU.
EXERCISES_ONLY ?=
nbgrader:
	$(GPY) -m labkit.tools.nbgrader_source --out course$(if $(EXERCISES_ONLY), --exercises-only)

reset:
	$(GPY) -m labkit.tools.handouts --strip notebooks/

clean:
	rm -rf $(VENV) runs test-results build *.egg-info hub/node_modules
