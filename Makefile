# Command 1 (fresh machine): make demo   -- set everything up, then run the main job
# Command 2:                 make test   -- run the test suite (sets up what it needs)
.PHONY: demo setup test slurm cluster-down bench lint
demo: setup
	./scripts/demo.sh
setup:
	./scripts/setup.sh
test:
	./scripts/test.sh
slurm:
	./scripts/local-cluster.sh up --nodes 2
cluster-down:
	./scripts/local-cluster.sh down
bench: setup
	.venv/bin/hvdkit bench --quick --out bench-results
lint:
	shellcheck scripts/*.sh .ci/run && .venv/bin/ruff check hvdkit tests && .venv/bin/mypy
