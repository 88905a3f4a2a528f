# Every target does its own set-up on a fresh machine. Every pip call passes the CPU torch
# constraint (constraints.txt); on a GPU machine install with `pip install -e ".[gpu]"` instead.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
CONSTRAINT := -c constraints.txt

.PHONY: venv dev demo test lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip $(CONSTRAINT)
	$(PIP) install $(CONSTRAINT) "torch==2.13.0"
	$(PIP) install $(CONSTRAINT) -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PIP) install $(CONSTRAINT) -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

dev: $(VENV)/.dev-installed

demo: venv
	$(VENV)/bin/dflash-train recipe=tiny_cpu

test: dev
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q

lint: dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs .pytest_cache
