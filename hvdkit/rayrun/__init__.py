"""hvdkit on a Ray cluster: the same training on Ray workers (``hvdkit run --launcher ray``) and
sweeps as Ray Tune experiments (``hvdkit sweep run --engine ray``).

* :mod:`.cluster`: which Ray cluster (an embedded local instance, or ``--ray-address``), the
  checks that refuse what cannot run before anything starts, and the connection.
* :mod:`.workers`: one rank per Ray worker in a placement group. Horovod goes through
  Horovod's own Ray runner (``horovod.ray.RayExecutor``); DDP through a worker group of the same
  shape. Each worker starts the rank as a child process, as every other launcher does, and
  relays its lines to the driver.
* :mod:`.tune`: a sweep's trials as a Tune experiment (ASHA, PBT), each trial a distributed run.

Nothing here imports ray at module level: ``hvdkit run --dry-run`` and the CLI stay light.
"""
