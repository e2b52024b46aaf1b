"""``hvdkit slurm --mem``'s memory check, in a process of its own: the one place the CLI sizes a
model (torch, a few seconds), so that rendering a script without ``--mem`` stays torch-free.

    python -m hvdkit.cli.jobmem NODES TASKS_PER_NODE MEM_BYTES BACKEND -- TRAIN_ARGS...

It prints one line: ``fits``, ``over <the refusal, with its HINT>``, or ``unknown <why>`` (the
model could not be sized on this machine: the run still checks its memory before step 1).
"""

from __future__ import annotations

import sys

from ..errors import first_line
from .validate import check_train_args


def main(argv: list[str]) -> int:
    """Print this job's verdict (see the module's docstring); 2 on bad arguments."""
    if len(argv) < 5 or argv[4] != "--":
        print("usage: python -m hvdkit.cli.jobmem NODES TASKS_PER_NODE MEM_BYTES BACKEND -- TRAIN_ARGS...",
              file=sys.stderr)
        return 2
    nodes, per_node, mem, backend, args = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[5:]
    cfg = check_train_args(args, backend=backend)
    try:
        from ..models import build_model_on_meta
        from ..preflight import job_check

        refusal = job_check(cfg, build_model_on_meta(cfg.model, cfg.model_args), nodes, per_node, mem)
    except Exception as exc:  # the user's factory, on this machine: not a verdict on the job
        print(f"unknown --model {cfg.model} could not be sized here ({type(exc).__name__}: {first_line(exc)})")
        return 0
    print("fits" if refusal is None else f"over {refusal}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
