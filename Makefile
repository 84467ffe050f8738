# The two commands a user needs: `make demo` and `make test`. Everything installs into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install build lint test demo bench clean

install: $(STAMP) build

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel "Cython>=3.0"
	$(BIN)/python -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

# Rebuild the Cython extensions in place when native/ changed (a no-op otherwise).
build: $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

# Lint and type-check the whole tree (configured in pyproject.toml), then the test suite.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m timely.launch -w 2 examples/wordcount.py
	$(BIN)/python examples/spark_demo.py --workers 2 --megaphone

# The benchmarks (figures go to bench/RESULTS.md by hand; plots to bench/plots or bench/out).
bench: install
	$(BIN)/python -m pip install -q -e '.[test,bench]' --config-settings editable_mode=compat
	$(BIN)/python bench/exchange.py
	$(BIN)/python bench/migration.py --out bench/plots
	$(BIN)/python bench/nexmark_bench.py --query q1,q3,q4 --variant both --rate 200000 --duration 6

clean:
	rm -rf build $(VENV) timely/_native/*.so nexmark/*.so native/*.c *.egg-info
