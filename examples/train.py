"""Train an example model: the same script on every backend.

    python examples/train.py                                   # one process (Horovod, 1 rank)
    horovodrun -np 2 -H localhost:2 --gloo python examples/train.py   # Horovod: the default backend
    mpirun -np 2 python examples/train.py --backend ddp        # DDP, no torchrun
    srun --mpi=pmix python examples/train.py                   # inside an allocation
    python examples/train.py --backend local                   # one plain process, no communication

All options: python examples/train.py --help (they are 'hvdkit train' options).
"""

import sys

from hvdkit.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
