"""Where a Ray sweep keeps its files under ``--out``, and the preemption handshake's files:
one home for the names the Tune driver (:mod:`.tune`), its preemption callback (:mod:`.preempt`)
and the sbatch renderer (:mod:`hvdkit.launch.slurm`) share. Imports nothing.
"""

__all__ = ["TUNE_DIR", "EXPERIMENT", "STATE_GLOB", "PREEMPT_FLAG", "PREEMPTED_DIR", "PREEMPTED_MARK",
           "PREEMPT_GRACE_S", "TUNER_STATE", "SEARCHER_GLOB"]

TUNE_DIR = "tune"          # under the sweep's --out: Tune's storage
EXPERIMENT = "experiment"  # its one experiment's name (Tuner.restore reads DIR/tune/experiment)
STATE_GLOB = "experiment_state-*.json"  # what Tune writes there once the experiment has a state
SEARCHER_GLOB = "basic-variant-state-*.json"  # beside it: the search algorithm's state (a pickle)
PREEMPT_FLAG = "preempting"      # under --out: the driver got USR1; trials checkpoint and stop
PREEMPTED_DIR = "preempted"      # under --out/trials: one file per trial whose ranks have stopped
PREEMPTED_MARK = "preempted"     # in an attempt's checkpoint dir: its ranks checkpointed at the signal
PREEMPT_GRACE_S = 60.0           # the most the driver waits for them (Slurm's --signal gives 90 s)
TUNER_STATE = "tuner.pkl"  # in DIR/tune/EXPERIMENT: what Tuner.restore needs (Ray's Tuner.can_restore looks for it)
