# Developer shortcuts; CI runs .ci/run, which performs the same lint and test steps.
PYTHON ?= python

.PHONY: lint format test test-gpu

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

test:
	$(PYTHON) -m pytest -q

test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -m gpu
