# Set-up in two commands:
#   make run                                        # the default cell (ARGS="strategy=fsdp_full prefetch=post")
#   make test                                       # the suite (PYTEST_ARGS="tests/test_report.py" narrows it)
# Both make .venv first when it is missing or older than pyproject.toml, installing as the README's manual steps
# do; a stamp file in .venv makes a second call install nothing (`make clean-venv` forgets it).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# torch first: the CPU build of 2.13.0 lies on this machine's disk (pip's find-links); a bare `torch`
# requirement, or the package's own `torch>=2.4` with no torch present, makes pip pull PyPI's CUDA build.
# Elsewhere pick the build you want, e.g. TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?=

VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip install -q
STAMP := $(VENV)/.zeroexp-installed

.PHONY: run test venv browser clean-venv

run: $(STAMP)
	$(VPY) -m zeroexp $(ARGS)

# The whole suite (PYTEST_ARGS empty; CI): two pytest runs side by side. The modules on two pytest-xdist workers, each
# module on one (its cells are shared there; the modules reading a shared session sweep are one unit:
# tests/conftest.py), at `nice` 10; beside them, ahead of them in the scheduler, the `serial` modules (a fresh
# `python -m zeroexp` signalled, or its time bounded in seconds), collected by their module marker, in one process:
# they wait on their fresh interpreters about half of their time, which the first run fills, and at nice 0 against 10
# they get a core whenever they ask (docs/benchmarks.md, The suite's time); in one process, not two workers, they
# spare a worker's start-up and forkserver and still end minutes before the first run. The first run's output
# streams; the serial run's is printed when both have ended. Exit: the first run's code, else the serial run's; on
# INT or TERM (Ctrl-C reaches the first run, the shell's group), the serial run is stopped too, and 143.
# With PYTEST_ARGS: one pytest run of what they name. Bytecode is written (__pycache__/, ignored by git) whatever
# PYTHONDONTWRITEBYTECODE says: each worker, forkserver and fresh `python -m zeroexp` of the suite then reads the
# modules the first one compiled, and the test modules as pytest rewrote their asserts (a collection 11 s -> 8 s).
test: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP) browser
ifeq ($(strip $(PYTEST_ARGS)),)
	@serial_log=$$(mktemp); \
	$(VPY) -m pytest -q --durations=10 -m serial \
	    $$(grep -l '^pytestmark = pytest.mark.serial' tests/test_*.py) >"$$serial_log" 2>&1 & serial=$$!; \
	trap 'kill $$serial 2>/dev/null; rm -f "$$serial_log"; exit 143' INT TERM; \
	nice -n 10 $(VPY) -m pytest -q --durations=15 -n 2 --dist loadfile -m "not serial"; rest_rc=$$?; \
	wait $$serial; serial_rc=$$?; trap - INT TERM; \
	echo "==== the serial modules (run beside the others): exit $$serial_rc ===="; cat "$$serial_log"; \
	rm -f "$$serial_log"; \
	if [ $$rest_rc -ne 0 ]; then exit $$rest_rc; fi; exit $$serial_rc
else
	$(VPY) -m pytest -q --durations=25 $(PYTEST_ARGS)
endif

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[dev]"
# The deepspeed extra: an sdist whose build imports torch, so no build isolation (an isolated build would pull a
# CUDA torch) and no prebuilt ops (~15 s; the CPU comm op is JIT-compiled at first use). Without it the
# DeepSpeed tests skip with the reason.
	$(PIP) setuptools wheel
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation "deepspeed>=0.19.2" \
	    || echo "deepspeed did not install: tests/test_deepspeed.py skips"
	touch $@

# The browser test of report.html (tests/test_report_browser.py) drives the system's Chromium headless. Installed
# when missing, only as root with apt-get; never fails the build: without it the test skips with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] \
	    || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	         && echo "installing chromium (apt-get) for tests/test_report_browser.py" \
	         && { apt-get install -y -q chromium >/dev/null 2>&1 \
	              || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } \
	         && echo "installed chromium" ; } \
	    || echo "chromium not installed: tests/test_report_browser.py skips"

clean-venv:
	rm -f $(STAMP)
