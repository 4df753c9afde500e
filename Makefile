# Strata: `make run` opens the app on the starter model; `make test` runs the whole suite.
# Both install what they need first (system libraries, a virtual environment, the model).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# offscreen only on a Linux box with no display at all (neither X11 nor Wayland).
export QT_QPA_PLATFORM ?= $(if $(filter Linux,$(shell uname -s)),$(if $(DISPLAY)$(WAYLAND_DISPLAY),,offscreen),)

.PHONY: setup run test lint bench app clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/system-deps.sh scripts/llama-cpp.sh
	./scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	./scripts/llama-cpp.sh $(BIN)/python
	touch $@

# system-deps again: a venv made before a library was added still gets it (silent, ~0.3 s).
run: setup
	./scripts/system-deps.sh
	$(BIN)/strata pull starter
	$(BIN)/strata

test: setup lint
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m pytest -q --durations=15

lint: setup
	$(BIN)/ruff check engine app tests packaging
	$(BIN)/mypy
	$(BIN)/mypy packaging/plist.py packaging/make_icons.py packaging/entry.py packaging/metal_check.py

bench: setup
	$(BIN)/strata pull starter >/dev/null
	$(BIN)/strata bench quick

# Strata.app (macOS arm64, ad-hoc signed) or dist/Strata/ (Linux); see packaging/README.md.
app: setup
	PY=$(BIN)/python ./packaging/build.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
