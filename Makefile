# Two commands do all the set-up on a fresh machine:
#   make demo   - the allreduce demo under mpiexec -n 4
#   make test   - the test suite
# Both create .venv on first use. TORCH_SPEC picks the torch to put in first:
# the CPU build of 2.13 by default; GPU users pass e.g. TORCH_SPEC=torch (or
# leave their CUDA torch in place with TORCH_SPEC=). Any other torch gets an
# environment of its own, .venv-<spec> (`make test TORCH_SPEC=torch==2.15.0`).
PYTHON ?= python3
DEFAULT_TORCH := torch==2.13.0
TORCH_SPEC ?= $(DEFAULT_TORCH)
OTHER_TORCH := $(filter-out $(DEFAULT_TORCH),$(TORCH_SPEC))
VENV ?= $(if $(OTHER_TORCH),.venv-$(subst <,lt,$(subst >,gt,$(subst =,-,$(subst ==,-,$(TORCH_SPEC))))),.venv)
PY := $(VENV)/bin/python
NP ?= 4
# The frameworks' recipes need the newest torch they were written for; another
# torch's environment gets the test and plot extras.
EXTRAS ?= $(if $(OTHER_TORCH),test$(comma)plot,test$(comma)plot$(comma)frameworks)
comma := ,
# A machine-wide pip constraint that caps torch would take another torch back
# down: that environment installs without the machine's pip configuration. Every
# environment pins the torch its first step put in, so no extra swaps it.
PIP_ENV := $(if $(OTHER_TORCH),PIP_CONFIG_FILE=/dev/null)
# the newest and the oldest torch ringcomm supports (make test-compat)
COMPAT_TORCH ?= torch==2.15.0 torch==2.7.1

.PHONY: install demo test test-wide test-scale test-compat test-compat-one test-cluster test-parallel test-bench test-frameworks test-ray test-gpu-check check-nccl-api conformance bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH_SPEC)" ]; then $(PIP_ENV) $(PY) -m pip install "$(TORCH_SPEC)"; fi
	$(PY) -m pip freeze | grep -i '^torch==' > $(VENV)/torch-pin.txt || true
	$(PIP_ENV) $(PY) -m pip install -c $(VENV)/torch-pin.txt -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m ringcomm.demo

# pytest over $(1), then $(PYTEST_ARGS); its exit code 5 (it collected no test) is a
# failure here
define pytest
	$(PY) -m pytest $(1) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc
endef

test: install
	$(call pytest,-m "not cluster and not frameworks and not ray and not parallel and not bench and not gpucheck and not wide and not scale")

# the launches make test leaves out because another launch there covers them: the
# other launcher, one rank, five oversubscribed ranks, the other ways a rank leaves,
# a timeout on the progress thread (about four minutes)
test-wide: install
	$(call pytest,-m wide)

# the checker's proofs at 1,024 and 4,096 ranks, and every built-in collective run
# on 256 to 1,024 in-process ranks (executor="events"), in one process (minutes)
test-scale: install
	$(call pytest,-m scale)

# torch's backend contract, the collectives, DDP, batch p2p and the init idioms
# on the newest and the oldest supported torch (COMPAT_TORCH), each in its own
# environment (about 3 GB each: PyPI's torch for x86_64 is a CUDA build, which
# runs on the CPU)
test-compat:
	for spec in $(COMPAT_TORCH); do $(MAKE) test-compat-one TORCH_SPEC=$$spec || exit 1; done

test-compat-one: install
	$(call pytest,-m compat)

# jobs across network-namespace hosts and on a local Slurm cluster (about two
# minutes; root, iproute2 and Debian's slurm-wlm, else they skip saying why)
test-cluster: install
	$(call pytest,-m cluster)

# DTensor, tensor and pipeline parallel, FSDP2 and DCP, 2-D meshes, and torchrun's
# restarts and elastic rendezvous (tests/test_parallel.py; about 4 minutes)
test-parallel: install
	$(call pytest,-m parallel)

# the benchmark tools (python -m ringcomm.bench, python -m ddp.bench) run on 2 ranks
# and their outputs checked (tests/test_bench*.py; about a minute and a half)
test-bench: install
	$(call pytest,-m bench)
	# the project's own speed targets, checked on the committed 2-rank run (a user's
	# run prints no verdicts)
	$(PY) -m ringcomm.bench --model-from docs/data/compare_2ranks.json \
	    --targets ringcomm/bench/targets.json --no-model
	$(PY) -m ringcomm.bench --model-from docs/data/pause_2ranks_gap100.json \
	    --targets ringcomm/bench/targets_pause.json --no-model

# PyTorch Lightning, HF Accelerate and transformers training on ringcomm under
# torchrun, DeepSpeed's ZeRO under torchrun, its own launcher and mpiexec against
# gloo, and torchft's recovery from killed replicas (about 4 minutes, two more the
# first time DeepSpeed builds its CPU Adam; the "frameworks" extra that make install
# brings)
test-frameworks: install
	$(call pytest,-m frameworks)

# Ray Train's TorchTrainer on ringcomm against gloo: installs the "ray" extra (about
# 400 MB, a minute and a half) into the environment, then about a minute
test-ray: install
	$(PIP_ENV) $(PY) -m pip install -c $(VENV)/torch-pin.txt -e ".[ray]"
	$(call pytest,-m ray)

# scripts/gpu_check.py's driver on CPU (--fake): every stage in order, deadlines
# that end their workers, the JSON and report kept when cut short (about a minute)
test-gpu-check: install
	$(call pytest,-m gpucheck)

# FakeNccl (the NCCL stand-in CI's CUDA path runs on) against the real
# cupy.cuda.nccl: CuPy's and NCCL's wheels (about 500 MB) import without a GPU
check-nccl-api: install
	$(PY) -m pip install "cupy-cuda12x>=13.6" "nvidia-nccl-cu12>=2.19"
	$(PY) -c "from cupy.cuda import nccl; assert nccl.available, 'NCCL did not load'"
	$(call pytest,tests/test_fake_nccl_api.py)

# torch's own distributed test suite against ringcomm (world size 3, CPU; about
# half an hour on 2 cores), then what 3 ranks skip for size at 4 and 8 ranks
# (about 15 minutes more): counts and every skip reason in docs/conformance.md
conformance: install
	$(PY) scripts/conformance.py; rc=$$?; \
	$(PY) scripts/conformance.py --sizes 4,8 || rc=1; exit $$rc

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
