# The two commands a newcomer needs: `make serve` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: env serve test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch lies on disk on our machines; install it explicitly before anything can pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

env: $(VENV)/.installed

# No MODEL: the embedded trained code model (models/default_model), or the random tiny demo where it is absent.
serve: env
	$(VENV)/bin/tierlm serve --host 127.0.0.1 --port 8000

test: env
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(filter-out models/default_model,$(wildcard models/*))  # the committed default stays
