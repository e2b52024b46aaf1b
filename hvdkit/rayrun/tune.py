"""A sweep as a Ray Tune experiment: each trial is a distributed run of ``np`` ranks.

The space file, the trial list and the results table are hvdkit's (hvdkit.sweep), so the two
engines run the same trials and can be compared, and ``scheduler: asha`` is hvdkit's own on
both (decisions on the shared file system, kept across a resume). Tune adds what needs a
service: Population Based Training (``scheduler: pbt``), restarts of failed
trials from their last checkpoint (``FailureConfig``), and ``Tuner.restore`` after the driver
was lost.

One trial: the trainable reserves a placement group (a sliver of a CPU for itself, then one
bundle per rank), starts the ranks as ``hvdkit run --launcher ray`` does, and relays rank 0's
``[hvdkit-epoch]`` lines to ``tune.report`` with that epoch's HDF5 checkpoint as Tune's
``Checkpoint``. A restarted or exploiting trial copies the checkpoint it was given into a
fresh checkpoint directory, and ``hvdkit train`` resumes from it exactly as after a requeue.
Checkpoint and metrics paths are on the file system every node shares (as for Slurm jobs).

Preemption (hvdkit's contract, as for one run): SIGUSR1 to the driver makes every running
trial's ranks checkpoint and stop; once they all have, Tune saves the experiment's state and
the driver exits 75. The requeued job (or ``--resume DIR``) restores the experiment, and each
preempted trial resumes from the checkpoint its ranks wrote at the signal, not from its last
epoch. Tune alone would stop at once and kill the trials' ranks mid-step.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import EXIT_NONFINITE, ConfigError
from ..log import warn
from ..observe import EPOCH_EVENTS_VAR, EPOCH_TAG
from ..preemption import EXIT_PREEMPTED
from ..sweep import SweepSpec, perturb_ranges, trial_command
from .cluster import RaySpec, worker_env
from .layout import (
    EXPERIMENT,
    PREEMPT_FLAG,
    PREEMPTED_DIR,
    PREEMPTED_MARK,
    SEARCHER_GLOB,
    STATE_GLOB,
    TUNE_DIR,
    TUNER_STATE,
)

__all__ = ["run_tune", "check_ray_sweep", "damaged_tune_state"]

# The trial itself only relays lines: it holds no resources (Tune's empty head bundle), so a
# cluster of exactly K x np rank slots runs K trials at once.
TRIAL_BUNDLE: dict[str, float] = {}
# exit codes of a trial's ranks that mean "it would do the same again": not retried
NOT_RETRIED = {2: "a usage error", EXIT_NONFINITE: "training diverged (NaN/inf loss or weights)"}
TRAINED_WITH = "params.json"  # in a trial's checkpoint home: the hyperparameters of its last attempt


def check_ray_sweep(spec: SweepSpec) -> None:
    """What the Ray engine refuses in the space, before Ray starts."""
    if "checkpoint_dir" in spec.fixed:
        raise ConfigError("checkpoint_dir in fixed: would be shared by every trial; the Ray engine gives each "
                          "trial its own", "remove checkpoint_dir from fixed:")
    if spec.scheduler == "pbt":
        perturb_ranges(spec)
        spec.asha_config()  # the budget: fixed: {epochs: N}


class _TrialConsole:
    """Lines of one trial's ranks: all to the trial's log, rank 0's epoch events to Tune."""

    def __init__(self, log: Path, on_epoch: Any) -> None:
        self.file = log.open("a")
        self.on_epoch = on_epoch

    def feed(self, line: str, sink: Any = None) -> None:
        at = line.find(EPOCH_TAG)
        if at >= 0:
            self.on_epoch(json.loads(line[at + len(EPOCH_TAG):]))
            return
        self.file.write(line)
        self.file.flush()


def _trainable(config: dict[str, Any], *, out: str, spec: SweepSpec, trials: list[dict[str, Any]], backend: str,
               ray_spec: RaySpec, env: dict[str, str], cwd: str) -> None:
    """One trial, inside Tune: the distributed run, its epochs reported with their checkpoints."""
    from ray import tune

    from .workers import PYTHON, run_job

    # which trial this is: PBT's exploit copies the donor's whole config, "trial" included, so
    # the identity is Tune's trial id, mapped to hvdkit's trial number when the trial first starts
    ids = Path(out) / "trials" / "tune-ids"
    ids.mkdir(parents=True, exist_ok=True)
    known = ids / tune.get_context().get_trial_id()
    if not known.exists():
        known.write_text(str(int(config["trial"])))
    index = int(known.read_text())
    params = {**trials[int(config["trial"])], **{k: config[k] for k in spec.perturb if k in config}}
    home = Path(out) / "checkpoints" / f"trial-{index:03d}"  # on the shared file system, as results/
    attempt = len(list(home.glob("attempt-*"))) if home.exists() else 0
    ck = home / f"attempt-{attempt}"  # fresh for every attempt: only what Tune gave is resumed
    ck.mkdir(parents=True, exist_ok=True)
    # what this attempt trains with (PBT changes it): the results table reports the last
    (home / TRAINED_WITH).write_text(json.dumps(params) + "\n")
    given = tune.get_checkpoint()
    origin: dict[str, Any] = {}
    if given is not None:
        with given.as_directory() as d:
            for h5 in Path(d).glob("*.h5"):
                shutil.copy2(h5, ck / h5.name)
            if (Path(d) / "origin.json").exists():
                origin = json.loads((Path(d) / "origin.json").read_text())
    elif attempt:
        # Tune gave none, yet this trial ran before: a driver lost before Tune's experiment
        # snapshot recorded the trial's checkpoints. Its own last checkpoints are on disk.
        earlier = sorted((p for p in home.glob("attempt-*/ckpt-*.h5")), key=lambda p: p.name)
        for h5 in earlier[-2:]:  # two: hvdkit falls back past a damaged newest one
            shutil.copy2(h5, ck / h5.name)
        if earlier:
            origin = {"trial": index, "epoch": f"{earlier[-1].stem} (from disk)"}
    exploited = origin.get("trial") if origin.get("trial") not in (None, index) else None
    if attempt and exploited is None and (home / f"attempt-{attempt - 1}" / PREEMPTED_MARK).exists():
        # the last attempt was preempted: its ranks checkpointed at the signal, after the epoch
        # Tune knows of; hvdkit train resumes from the newest file in the directory
        for h5 in sorted((home / f"attempt-{attempt - 1}").glob("ckpt-*.h5"))[-2:]:
            shutil.copy2(h5, ck / h5.name)
            origin["preempted"] = h5.name
    results = Path(out) / "results"
    results.mkdir(parents=True, exist_ok=True)
    finished = _finished(results / f"ray-{index}.json")
    if finished is not None:
        # its ranks completed every epoch before the driver was lost (Tune had not recorded the
        # last report yet): report what they recorded, do not train the last epoch again
        tune.report({**finished, "exploited_from": -1, "lr": float(params.get("lr", float("nan"))),
                     "hvdkit_trial": index})
        return
    # --no-requeue: under Slurm the ranks inherit SLURM_JOB_ID, but the job is the experiment's,
    # which the driver's batch shell requeues once every trial has checkpointed
    args = [*trial_command(Path(out), spec, index, params), "--checkpoint-dir", str(ck),
            "--metrics-file", str(results / f"ray-{index}.json"), "--no-requeue"]
    flag = Path(out) / PREEMPT_FLAG
    stopped = Path(out) / "trials" / PREEMPTED_DIR / tune.get_context().get_trial_id()

    def report(metrics: dict[str, Any], path: str | None) -> None:
        if not path or not Path(path).exists():
            tune.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy2(path, Path(tmp) / Path(path).name)
            (Path(tmp) / "origin.json").write_text(json.dumps({"trial": index, "epoch": metrics["epochs"]}))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))

    last: list[tuple[dict[str, Any], str | None]] = []  # the final epoch's report, held back

    def on_epoch(event: dict[str, Any]) -> None:
        metrics = {k: v for k, v in event.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics["final_loss"] = metrics.get("loss", float("nan"))
        metrics["epochs"] = int(event["epoch"]) + 1
        metrics["exploited_from"] = -1 if exploited is None else int(exploited)
        metrics["lr"] = float(params.get("lr", float("nan")))
        metrics["hvdkit_trial"] = index
        if metrics["epochs"] >= spec.epochs:
            # Tune stops a trial at its last epoch (the stop criterion, ASHA's max_t) and ends
            # this trainable with it: reported now, the ranks could be killed before hvdkit
            # train writes its metrics file, and a finished trial would read as pruned (seen in
            # CI). Reported once the ranks have exited.
            last.append((metrics, event.get("checkpoint")))
            return
        report(metrics, event.get("checkpoint"))

    console = _TrialConsole(Path(out) / "trials" / f"trial-{index:03d}.log", on_epoch)
    if origin:
        console.file.write(f"[hvdkit] tune: restored from trial {origin.get('trial', index)}'s checkpoint of epoch "
                           f"{origin.get('epoch', '?')} with {params}\n")
    if "preempted" in origin:
        console.file.write(f"[hvdkit] tune: attempt {attempt - 1} was preempted: its own newer checkpoint "
                           f"{origin['preempted']} comes too\n")
    program = [PYTHON, "-m", "hvdkit", "train", "--backend", backend, *args]
    told: list[int] = []

    def preempt() -> list[int]:  # once, when the driver asks: the ranks checkpoint and exit 75
        if told or not flag.exists():
            return []
        told.append(signal.SIGUSR1)
        return [signal.SIGUSR1]

    # the ranks start in the driver's working directory, as under the local engine (Tune moved
    # this trainable into its trial directory): relative paths in the space mean the same
    code = 0 if flag.exists() else run_job(ray_spec, backend, program, {**env, EPOCH_EVENTS_VAR: "1"}, console,
                                           poll=preempt, cwd=cwd)
    if flag.exists():
        if code == EXIT_PREEMPTED:
            (ck / PREEMPTED_MARK).touch()
        console.file.write(f"[hvdkit] tune: preempted (ranks exited {code}); the experiment resumes this trial\n")
        console.file.close()
        stopped.parent.mkdir(parents=True, exist_ok=True)
        stopped.touch()
        # neither finished nor failed: Tune saves the experiment with this trial running, and
        # ends this actor when it stops; a restore then resumes the trial
        threading.Event().wait()
    console.file.close()
    if code in NOT_RETRIED:
        # it would fail the same way again: recorded as failed, and ended without an error, so
        # --max-failures does not run it again from scratch
        (results / f"ray-{index}.json").write_text(json.dumps({
            "status": "failed", "history": [], "error": f"{NOT_RETRIED[code]} (exit {code}; see {console.file.name})"},
            indent=2) + "\n")
        return
    if code != 0:
        raise RuntimeError(f"trial {index}'s ranks exited with {code}; see {console.file.name}")
    for metrics, path in last[-1:]:
        report(metrics, path)


def _finished(path: Path) -> dict[str, Any] | None:
    """The last epoch's record of a trial whose ``hvdkit train`` ended (completed, or pruned at a
    rung), from its metrics file, as the trainable reports epochs; None when it has not."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    history = data.get("history") or []
    if data.get("status") not in ("completed", "pruned") or not history:
        return None
    last = {k: v for k, v in history[-1].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**last, "final_loss": last.get("loss", float("nan")), "epochs": len(history)}


def _scheduler(spec: SweepSpec) -> Any:
    from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining

    metric_mode: dict[str, Any] = {"metric": _tune_metric(spec), "mode": spec.mode}
    # scheduler: asha is hvdkit's own (hvdkit.asha, the local engine's): each trial's rank 0
    # decides at its rungs from the records in DIR/asha, and a decision, once made, is on disk.
    # Tune's ASHAScheduler keeps its rungs in memory, and Tuner.restore starts them empty: a
    # resumed sweep completed trials the uninterrupted one had pruned, and picked another best.
    if spec.scheduler == "pbt":
        from ray import tune

        ranges = perturb_ranges(spec)
        domains = {"uniform": tune.uniform, "loguniform": tune.loguniform,
                   "int": lambda lo, hi: tune.randint(lo, hi + 1)}  # Tune's upper bound is exclusive
        mutations = {k: r if isinstance(r, list) else domains[r[0]](r[1], r[2]) for k, r in ranges.items()}
        return PopulationBasedTraining(time_attr="epochs", perturbation_interval=spec.grace,
                                       hyperparam_mutations=mutations, quantile_fraction=0.5, synch=False,
                                       custom_explore_fn=functools.partial(_within, ranges=ranges), **metric_mode)
    return FIFOScheduler()


def _within(config: dict[str, Any], *, ranges: dict[str, Any]) -> dict[str, Any]:
    """PBT's explore step multiplies a value by 0.8 or 1.2: bring it back into the key's range
    (an int whole, rounded by Tune), so a momentum of 0.95 never becomes 1.14."""
    for key, r in ranges.items():
        if isinstance(r, tuple) and key in config:
            value = min(max(config[key], r[1]), r[2])
            config[key] = int(round(value)) if r[0] == "int" else float(value)
    return config


def damaged_tune_state(experiment: Path) -> str | None:
    """The first of Ray's saved experiment files that cannot be read back, as 'FILE (why)', or
    None when ``Tuner.restore`` can use them. Ray's syncer copies them into the storage path in
    place, not by rename: a driver killed during that copy leaves a truncated file, and Tune
    then restores an experiment with one new trial and an empty config (seen: a 0-byte
    basic-variant-state-*.json after SIGKILL)."""
    import pickle

    from ray import cloudpickle

    def newest(pattern: str) -> list[Path]:
        found = sorted(experiment.glob(pattern))  # Ray restores the newest by name (a timestamp)
        return found[-1:]

    for path in [experiment / TUNER_STATE, *newest(STATE_GLOB), *newest(SEARCHER_GLOB)]:
        try:
            if path.stat().st_size == 0:
                return f"{path} (empty)"
            with path.open("rb") as f:
                if path.name.startswith("experiment_state-"):
                    json.load(f)
                else:
                    cloudpickle.load(f)
        except FileNotFoundError:
            if path.name == TUNER_STATE:
                return f"{path} (missing)"
        except (OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            return f"{path} ({type(exc).__name__}: {exc})"
    return None


def _tune_metric(spec: SweepSpec) -> str:
    return "final_loss" if spec.metric in ("final_loss", "loss") else spec.metric


def run_tune(out: Path, spec: SweepSpec, trials: list[dict[str, Any]], backend: str, ray_spec: RaySpec,
             resume: bool = False, max_failures: int = 2) -> dict[str, Any]:
    """Run (or with ``resume`` continue) the experiment; write each trial's results file where
    ``hvdkit train`` did not (a pruned or failed trial), so hvdkit.sweep.collect_results reads all."""
    import os
    import warnings

    # Tune's own console (its experiment box, a TensorBoard hint, advice for class trainables)
    # would bury hvdkit's table; its files under DIR/tune keep everything
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.tune")
    from ray import tune

    bundles = [TRIAL_BUNDLE] + [ray_spec.bundle] * ray_spec.np  # the caller checked that one fits (check_fits)
    flag = out / PREEMPT_FLAG
    flag.unlink(missing_ok=True)  # a requeued job's: the trials run again
    shutil.rmtree(out / "trials" / PREEMPTED_DIR, ignore_errors=True)
    if threading.current_thread() is threading.main_thread():
        # until Tune runs (the callback then takes USR1 over), a preemption is only noted
        signal.signal(signal.SIGUSR1, lambda _s, _f: flag.touch())
    from .preempt import TunePreemption
    trainable = tune.with_resources(
        # the ranks' environment from this shell: a trainable runs in a Ray worker, whose own is the raylet's
        functools.partial(_trainable, out=str(out), spec=spec, trials=trials, backend=backend, ray_spec=ray_spec,
                          env=worker_env({}, forward=ray_spec.forward), cwd=os.getcwd()),
        tune.PlacementGroupFactory(bundles, strategy="PACK"))
    storage = str((out / TUNE_DIR).resolve())
    damage = damaged_tune_state(Path(storage) / EXPERIMENT) if resume else None
    if damage is not None:
        # hvdkit keeps what a trial needs to go on in its own files (each attempt's checkpoints,
        # each finished trial's results, ASHA's decisions): a fresh experiment resumes every
        # trial from them. What is lost is Tune's own history (PBT's exploits before the loss).
        aside = Path(storage) / f"{EXPERIMENT}-damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        (Path(storage) / EXPERIMENT).rename(aside)
        warn(f"Ray's saved experiment cannot be restored: {damage}. Moved it to {aside}; every "
             f"trial resumes from its own checkpoints under {out / 'checkpoints'} in a new experiment")
        resume = False
    if resume:
        tuner = tune.Tuner.restore(str(Path(storage) / EXPERIMENT), trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        space: dict[str, Any] = {"trial": tune.grid_search(list(range(len(trials))))}
        for key in spec.perturb if spec.scheduler == "pbt" else ():
            space[key] = tune.sample_from(functools.partial(_initial, key=key, trials=trials, fixed=spec.fixed))
        tuner = tune.Tuner(
            trainable, param_space=space,
            # no max_concurrent_trials: every trial is created at once (PENDING) and the cluster's
            # resources decide how many run. A cap leaves later trials ungenerated, and then
            # (1) PBT cannot take turns with them, and (2) Tuner.restore after a lost driver waited
            # forever for a trial the snapshot never held (seen: --parallel 1, 3 trials)
            tune_config=tune.TuneConfig(scheduler=_scheduler(spec), num_samples=1, reuse_actors=False),
            run_config=tune.RunConfig(name=EXPERIMENT, storage_path=storage, verbose=0,
                                      callbacks=[TunePreemption(out)],  # restored with the experiment
                                      # ended at its last epoch, not paused there for PBT to resume
                                      stop={"epochs": spec.epochs},
                                      failure_config=tune.FailureConfig(max_failures=max_failures),
                                      # PBT exploits older checkpoints of other trials: keep them all
                                      checkpoint_config=tune.CheckpointConfig(
                                          num_to_keep=None if spec.scheduler == "pbt" else 2)))
    grid = tuner.fit()
    summary: dict[str, Any] = {"trials": len(trials), "errors": 0, "exploits": [], "preempted": flag.exists()}
    if summary["preempted"]:
        return summary  # the trials resume with the experiment; their results are not final
    for result in list(grid):  # type: ignore[call-overload]
        frame = result.metrics_dataframe
        rows = frame.to_dict("records") if frame is not None else []
        index = int(rows[-1]["hvdkit_trial"]) if rows else int(result.config["trial"])
        before = -1
        for r in rows:  # an exploit starts an attempt: its first report names the donor
            donor = int(r.get("exploited_from", -1))
            if donor >= 0 and donor != before:
                summary["exploits"].append({"trial": index, "from": donor, "epoch": int(r["epochs"]) - 1})
            before = donor
        summary["errors"] += result.error is not None
        path = out / "results" / f"ray-{index}.json"
        status = json.loads(path.read_text()).get("status") if path.exists() else None
        done = status == "completed"
        if status == "failed":  # the trainable recorded why (a failure it does not retry)
            summary["errors"] += 1
            continue
        if status == "pruned":  # hvdkit's ASHA stopped it at a rung; its own record stands
            continue
        trained = out / "checkpoints" / f"trial-{index:03d}" / TRAINED_WITH
        if done and spec.scheduler == "pbt":
            data = json.loads(path.read_text())
            data["exploited_from"] = sorted({e["from"] for e in summary["exploits"] if e["trial"] == index})
            if trained.exists():
                data["params"] = json.loads(trained.read_text())
            path.write_text(json.dumps(data, indent=2) + "\n")
        if done:
            continue
        history = [{k: v for k, v in r.items() if k in ("epoch", "loss") or k.startswith("val_")} for r in rows]
        last = rows[-1] if rows else {}
        value = last.get(_tune_metric(spec))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "status": "failed" if result.error is not None else "pruned", "history": history,
            **({"params": json.loads(trained.read_text())} if trained.exists() and spec.scheduler == "pbt" else {}),
            spec.metric: value if isinstance(value, float) and math.isfinite(value) else None,
            "error": str(result.error).splitlines()[0] if result.error is not None else None}, indent=2) + "\n")
    return summary


def _initial(spec: Any, *, key: str, trials: list[dict[str, Any]], fixed: dict[str, Any]) -> Any:
    """A PBT-perturbed key's first value: the trial's own, from the space."""
    return trials[int(spec.config["trial"])].get(key, fixed.get(key))
