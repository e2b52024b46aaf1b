"""hvdkit on Ray, with real Ray processes: ``hvdkit run --launcher ray`` on both backends and
``hvdkit sweep run --engine ray`` (Ray Tune's ASHA and PBT, a trial restarted from its
checkpoint after its rank was killed). One Ray head is started for the module (``ray start
--head --block``, stopped by its PID) and every command joins it with --ray-address, so the
tests pay Ray's start-up once; one test uses the embedded instance that is the default.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import HVDKIT, ROOT, base_env, check, launch, stop_process_group, wait_until

pytestmark = [pytest.mark.ray]  # one Ray head at a time on this machine (tests/conftest.py)
pytest.importorskip("ray")  # the [ray] extra: scripts/setup.sh installs it, so this runs in make test

MODELS = str(ROOT / "examples" / "models.py")
MLP = ["--model", "mlp", "--epochs", "2", "--steps-per-epoch", "8", "--num-samples", "1024"]
DIGEST = re.compile(r"digest=(\w+)")


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Iterator[str]:
    """One Ray head for the module, on 127.0.0.1, with a token of its own (given to the commands
    that join it through the file RAY_AUTH_TOKEN_PATH names, as a user would); its process
    group is killed by PID at the end."""
    from hvdkit.environments import find_free_port
    from hvdkit.rayrun.auth import new_token

    port = find_free_port("127.0.0.1")
    here = tmp_path_factory.mktemp("ray")
    log, token = here / "head.log", here / "token"
    token.write_text(new_token())
    token.chmod(0o600)
    env = base_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    with log.open("w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                 "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "5",
                                 "--include-dashboard", "false", "--disable-usage-stats"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: "Ray runtime started" in log.read_text() or proc.poll() is not None, 120,
                   "the Ray head to start")
        assert proc.poll() is None, f"ray start --head exited {proc.returncode}: " + log.read_text()[-3000:]
        JOIN_ENV["RAY_AUTH_TOKEN_PATH"] = str(token)
        yield address
    finally:
        JOIN_ENV.clear()
        stop_process_group(proc)


JOIN_ENV: dict[str, str] = {}  # what a command needs to join the module's head (its token), set by head()


def ray_env(**extra: str) -> dict[str, str]:
    """base_env, with what joining the module's head takes."""
    return base_env(**{**JOIN_ENV, **extra})


def hvdkit(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*HVDKIT, *args], env=ray_env(**(env or {})), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("digits")
    check(subprocess.run([*HVDKIT, "data", "import-digits", str(d)], env=base_env(), capture_output=True,
                         text=True, timeout=120))
    return d


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 75 s on 2 cores
@pytest.mark.parametrize("backend,kind", [("horovod", "hvd-gloo"), ("ddp", "mpirun")])
def test_ray_launcher_trains_to_the_digest_of_horovodrun_and_mpirun(head, backend, kind, tmp_path):
    ray = hvdkit("run", "-np", "2", "--launcher", "ray", "--ray-address", head, "--backend", backend, "--", *MLP,
                 "--checkpoint-dir", str(tmp_path / "ck"))
    assert ray.returncode == 0, ray.stdout[-3000:] + ray.stderr[-3000:]
    assert "Traceback" not in ray.stdout + ray.stderr
    native = check(launch(kind, 2, [*HVDKIT, "train", "--backend", backend, *MLP]))
    assert DIGEST.search(ray.stdout).group(1) == DIGEST.search(native).group(1)
    assert "params_identical_on_all_ranks=True" in ray.stdout
    assert sorted(p.name for p in (tmp_path / "ck").glob("ckpt-*.h5"))[-1] == "ckpt-000000016.h5"


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 70 s on 2 cores
def test_ray_run_relays_a_preemption_signal_and_the_resumed_run_ends_on_the_same_bits(head, tmp_path):
    """SIGUSR1 to 'hvdkit run --launcher ray' (what Slurm sends a batch shell) reaches every rank,
    held at step 5: they checkpoint and exit 75; the rerun resumes and ends like a straight run.
    The embedded Ray instance (no --ray-address) is the default users get: this test uses it, in
    a home of its own, where it must leave no ~/.ray/auth_token behind (Ray's own default would
    write one, and the user's next 'ray start --head' would then turn authentication on)."""
    run = ["run", "-np", "2", "--launcher", "ray", "--backend", "ddp"]
    home = tmp_path / "home"
    home.mkdir()
    sessions_before = set(Path("/tmp").glob("hvdkit-ray-*"))
    proc = subprocess.Popen([*HVDKIT, *run, "--", *MLP, "--checkpoint-dir", str(tmp_path / "ck")], text=True,
                            env=base_env(HVDKIT_HOLD="step:5", HVDKIT_HOLD_RELEASE="signal", HOME=str(home)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if sum("holding at step 5" in x for x in lines) == 2:
                proc.send_signal(signal.SIGUSR1)
                break
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=180) == 75, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert "preempted at step 5 by SIGUSR1; checkpoint saved" in out, out[-2000:]
    assert not (home / ".ray").exists()
    # the embedded instance's session files (50-260 of them) went with it (#44 class 8)
    assert set(Path("/tmp").glob("hvdkit-ray-*")) == sessions_before
    resumed = hvdkit(*run, "--ray-address", head, "--", *MLP, "--checkpoint-dir", str(tmp_path / "ck"))
    straight = hvdkit(*run, "--ray-address", head, "--", *MLP)
    assert resumed.returncode == 0 == straight.returncode, resumed.stdout[-2000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert DIGEST.search(resumed.stdout).group(1) == DIGEST.search(straight.stdout).group(1)


@pytest.mark.mp
@pytest.mark.timeout(400)  # measured 9-12 s each on 2 cores
@pytest.mark.parametrize("point", ["launch", "setup"])
def test_a_preemption_while_ray_starts_the_ranks_stops_them_cleanly(head, tmp_path, point):
    """#44 class 10 on Ray: USR1 before any rank started exits 75 and starts none; USR1 while the
    ranks hold in set-up (no handler of their own yet) reaches them as their stop file, and they
    checkpoint at their first step. It was rc 246 ('the launcher exited with status -10')."""
    from helpers import start_up_preemption

    code, out, ck = start_up_preemption(tmp_path, ["--launcher", "ray", "--ray-address", head, "--backend", "ddp"],
                                        point, env=JOIN_ENV)
    assert code == 75, out
    if point == "launch":
        assert "preempted (exit 75) before the ranks started: nothing ran" in out and not ck.exists(), out
    else:
        assert "the ranks saved a checkpoint at step 1" in out and (ck / "ckpt-000000001.h5").is_file(), out


@pytest.mark.timeout(300)  # measured 25 s on 2 cores
def test_ray_refusals_are_one_line_before_anything_runs(head, tmp_path):
    from hvdkit.environments import find_free_port

    closed = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    space = tmp_path / "s.yaml"
    space.write_text("metric: final_loss\nfixed: {model: mlp, epochs: 2}\ngrid: {lr: [0.1]}\nscheduler: pbt\n")
    shared = tmp_path / "c.yaml"
    shared.write_text("fixed: {model: mlp, epochs: 2, checkpoint_dir: ck}\ngrid: {lr: [0.1]}\n")
    plain = tmp_path / "p.yaml"
    plain.write_text("fixed: {model: mlp, epochs: 2}\ngrid: {lr: [0.1]}\n")
    empty = tmp_path / "resumed"  # a --resume whose tune/ holds nothing Tune can restore
    (empty / "tune" / "experiment").mkdir(parents=True)
    (empty / "spec.json").write_text(json.dumps({"grid": {"lr": [0.1]}}))
    cases: list[tuple] = [
        (["run", "--launcher", "ray", "--ray-address", closed, "--", "--model", "mlp"],
         f"no Ray cluster answers at {closed}"),
        (["run", "-np", "64", "--launcher", "ray", "--ray-address", head, "--", "--model", "mlp"],
         "-np 64 needs 64 CPU (cluster has 5): Ray would wait for them forever"),
        (["run", "-np", "2", "--launcher", "ray", "--ray-placement", "spread", "--ray-address", head, "--",
          "--model", "mlp"], "--ray-placement spread puts one rank per node, and only 1 of the cluster's 1"),
        (["run", "--launcher", "ray", "--elastic", "--host-discovery-script", "x", "--", "--model", "mlp"],
         "--elastic cannot be combined with --launcher ray"),
        (["run", "--ray-placement", "spread", "--", "--model", "mlp"], "--ray-placement places ranks on Ray"),
        (["run", "--launcher", "ray", "--", "--model", "mlp", "--lr", "abc"], "--lr"),
        (["sweep", "run", str(space), "--out", str(tmp_path / "o1")], "scheduler: pbt runs on Ray Tune"),
        (["sweep", "run", str(shared), "--engine", "ray", "--out", str(tmp_path / "o2")],
         "checkpoint_dir in fixed: would be shared by every trial"),
        (["sweep", "run", str(plain), "--engine", "ray", "-np", "8", "--ray-address",
          head, "--out", str(tmp_path / "o3")], "a trial needs 8 CPU (cluster has 5)"),
        (["sweep", "run", str(plain), "--engine", "ray", "--slurm", "--ray-address", head,
          "--out", str(tmp_path / "o4")], "--slurm starts Ray inside the job"),
        (["sweep", "run", str(plain), "--engine", "ray", "--slurm", "-N", "2", "--parallel", "3",
          "--out", str(tmp_path / "o5")], "--parallel 3 trials of -np 1 ranks do not fill --nodes 2 evenly"),
        (["sweep", "run", str(plain), "-N", "2", "--out", str(tmp_path / "o6")],
         "--nodes sizes the job of --engine ray --slurm"),
        # #44 class 8
        (["run", "--launcher", "ray", "--ray-address", "localhost:\u00b2", "--", "--model", "mlp"],
         "--ray-address 'localhost:\u00b2' is not host:port"),
        (["run", "--launcher", "ray", "--iface", "bogus0", "--", "--model", "mlp"],
         "network interface 'bogus0' (--iface) does not exist"),
        (["run", "--launcher", "ray", "--", "--model", "mlp", "--elastic"],
         "training's --elastic needs Horovod Elastic's driver"),
        (["sweep", "run", str(plain), "--engine", "ray", "--resume", str(empty), "--ray-address", head],
         f"{empty} holds no Ray sweep to resume"),
        (["run", "--launcher", "ray", "-x", "HVDKIT_TEST_UNSET", "--", "--model", "mlp"],
         "-x HVDKIT_TEST_UNSET: this shell has no variable HVDKIT_TEST_UNSET to pass on"),
    ]
    # joining a cluster with token authentication: no token, a wrong one; and something that
    # answers TCP but is not Ray (an HTTP server)
    import http.server
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    # and one that greets as sshd does, then says nothing more
    import socketserver

    class Banner(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            self.request.recv(1 << 16)  # until the client gives up

    ssh = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Banner)
    ssh.daemon_threads = True
    threading.Thread(target=ssh.serve_forever, daemon=True).start()
    fresh = {"RAY_AUTH_TOKEN_PATH": "", "HOME": str(tmp_path / "home")}
    join = ["run", "--launcher", "ray", "--ray-address", head, "--", "--model", "mlp"]
    cases += [
        (join, fresh, f"the Ray cluster at {head} uses token authentication and this shell has no token"),
        (join, {"RAY_AUTH_TOKEN": "0" * 64}, f"the Ray cluster at {head} refused the token from RAY_AUTH_TOKEN"),
        (join, {"RAY_AUTH_MODE": "disabled"}, f"RAY_AUTH_MODE=disabled, but the Ray cluster at {head} uses token"),
        (["run", "--launcher", "ray", "--ray-address", f"127.0.0.1:{web.server_address[1]}", "--", "--model", "mlp"],
         {}, "is not a Ray cluster's head"),
        (["run", "--launcher", "ray", "--ray-address", f"127.0.0.1:{ssh.server_address[1]}", "--", "--model", "mlp"],
         {}, "is not a Ray cluster's head"),
        # an address from the environment is named as such, not blamed on the option
        (["run", "--launcher", "ray", "--", "--model", "mlp"], {"RAY_ADDRESS": closed}, "(RAY_ADDRESS: "),
    ]
    try:
        for args, env, expected in [c if len(c) == 3 else (c[0], {}, c[1]) for c in cases]:
            started = time.monotonic()
            proc = hvdkit(*args, timeout=120, env=env)
            said = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and expected in proc.stderr, (args, proc.stderr[-1500:])
            assert len(said) == 1 or said[-1].startswith("Error:"), (args, said)
            assert "Traceback" not in proc.stderr and time.monotonic() - started < 60, args
    finally:
        web.shutdown()
        ssh.shutdown()
    assert not (tmp_path / "ck").exists() and not (tmp_path / "home").exists()
    assert not (tmp_path / "o3").exists(), "a sweep refused for its size wrote its trials"
    # Ray not installed: the same one line from every Ray option, naming the extra
    hidden = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None; "
                             "from hvdkit.cli import main; sys.argv = ['hvdkit'] + sys.argv[1:]; main()",
                             "run", "--launcher", "ray", "--", "--model", "mlp"],
                            env=base_env(), capture_output=True, text=True, timeout=60)
    assert hidden.returncode == 2 and "Ray is not installed in this environment" in hidden.stderr
    assert "pip install 'hvdkit[ray]'" in hidden.stderr


def _space(tmp_path: Path, digits: Path, name: str, body: str, epochs: int = 3, relative: bool = False) -> Path:
    """A digits space; ``relative``: its model and data paths relative to ``tmp_path`` (run the
    sweep there), as a user writes them."""
    path = tmp_path / name
    models, data = (os.path.relpath(p, tmp_path) for p in (MODELS, digits)) if relative else (MODELS, digits)
    path.write_text(f"metric: val_accuracy\nmode: max\nfixed: {{model: {models}:digits_cnn, data: {data}/train.h5, "
                    f"val_data: {data}/val.h5, batch_size: 32, optimizer: adamw, epochs: {epochs}}}\n{body}")
    return path


@pytest.mark.mp
@pytest.mark.timeout(900)  # measured 90 s on 2 cores
def test_tune_asha_prunes_bad_trials_and_picks_the_best_on_val_accuracy(head, digits, tmp_path):
    space = _space(tmp_path, digits, "asha.yaml", "grid: {lr: [0.003, 0.002, 0.001, 0.00001, 0.00002, 0.00003]}\n"
                   "scheduler: asha\neta: 3\ngrace: 1\n")
    proc = hvdkit("sweep", "run", str(space), "--engine", "ray", "-np", "2", "--ray-address", head,
                  "--out", str(tmp_path / "out"), timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    status = {r["trial"]: r["status"] for r in rows}
    assert len(rows) == 6 and "pruned" in status.values() and "failed" not in status.values(), status
    assert all(r["epochs"] == 1 for r in rows if r["status"] == "pruned")
    done = [r for r in rows if r["status"] == "completed"]
    best = max(done, key=lambda r: r["val_accuracy"])
    assert f"best: trial {best['trial']} val_accuracy=" in proc.stdout and best["val_accuracy"] > 0.9
    assert (tmp_path / "out" / "results.png").is_file() and "| pruned |" in proc.stdout
    # hvdkit's ASHA decided, on disk (a resumed sweep reuses each decision): one per trial at rung 1
    decided = sorted(p.name for p in (tmp_path / "out" / "asha" / "decisions").glob("trial-*.json"))
    assert decided == [f"trial-{t:03d}-epoch-0001.json" for t in range(6)], decided


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 36-39 s on 2 cores (3 runs)
def test_tune_pbt_exploits_by_copying_a_better_trials_checkpoint(head, digits, tmp_path):
    # paths relative to the working directory, as on the local engine (Tune moves each trial
    # into a directory of its own; the ranks start in the driver's)
    space = _space(tmp_path, digits, "pbt.yaml", "grid: {lr: [0.003, 0.00001]}\n"
                   "scheduler: pbt\ngrace: 1\nperturb: [lr]\n", relative=True)
    # a good and a bad trial, room for one at a time (3 of the head's 5 CPUs): PBT takes turns (a
    # trial pauses at each epoch while the other runs), so at epoch 2 both have a score and the
    # good one (the upper half) a recorded checkpoint when the bad one asks to exploit; trials side
    # by side race past that point. One rank a trial keeps the restarts cheap.
    proc = hvdkit("sweep", "run", space.name, "--engine", "ray", "-np", "1", "-c", "3", "--ray-address", head,
                  "--out", "out", timeout=800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "tune-summary.json").read_text())
    assert summary["exploits"], summary
    first = summary["exploits"][0]
    assert f"pbt: trial {first['trial']} exploited trial {first['from']}'s checkpoint" in proc.stdout
    log = (tmp_path / "out" / "trials" / f"trial-{first['trial']:03d}.log").read_text()
    assert f"tune: restored from trial {first['from']}'s checkpoint" in log and "resumed from" in log
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(r["status"] == "completed" for r in rows), rows
    # the table names what each trial trained with at the end: the exploiter's perturbed lr,
    # one of the space's values (a grid key stays among the grid's)
    trained = json.loads((tmp_path / "out" / "checkpoints" / f"trial-{first['trial']:03d}" / "params.json").read_text())
    assert rows[first["trial"]]["params"] == trained and trained["lr"] in (0.003, 0.00001), (rows, trained)


@pytest.mark.mp
@pytest.mark.timeout(900)  # measured 80 s on 2 cores
def test_tune_trial_whose_rank_is_killed_restarts_from_its_checkpoint_and_ends_on_the_same_bits(
        head, digits, tmp_path):
    """Both ranks hold at step 30 (epoch 2, after epoch 1's checkpoint at step 23); rank 1 is
    SIGKILLed there; the trial fails, Tune restarts it from its checkpoint, and it ends on the
    weights of the same trial run without a fault."""
    space = _space(tmp_path, digits, "one.yaml", "grid: {lr: [0.002]}\n")
    release = tmp_path / "release"
    out = tmp_path / "out"
    proc = subprocess.Popen([*HVDKIT, "sweep", "run", str(space), "--engine", "ray", "-np", "2", "--ray-address",
                             head, "--out", str(out)], env=ray_env(HVDKIT_HOLD="step:30",
                                                                     HVDKIT_HOLD_RELEASE=str(release)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = out / "trials" / "trial-000.log"
        wait_until(lambda: log.exists() and log.read_text().count("holding at step 30") == 2, 300,
                   "both ranks to hold at step 30")
        rank1 = re.search(r"\[1\]<stderr>:\[hvdkit\] holding at step 30 \(pid (\d+)\)", log.read_text())
        os.kill(int(rank1.group(1)), signal.SIGKILL)
        release.touch()
        stdout, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:]
    text = log.read_text()
    assert "tune: restored from trial 0's checkpoint of epoch 1" in text and "(step 23)" in text
    faulted = json.loads((out / "results" / "ray-0.json").read_text())
    straight = hvdkit("sweep", "run", str(space), "--engine", "ray", "-np", "2", "--ray-address", head,
                      "--out", str(tmp_path / "straight"), timeout=600)
    assert straight.returncode == 0, straight.stderr[-2000:]
    clean = json.loads((tmp_path / "straight" / "results" / "ray-0.json").read_text())
    assert faulted["param_digest"] == clean["param_digest"] and faulted["global_step"] == clean["global_step"] == 69


@pytest.mark.mp
@pytest.mark.timeout(900)  # measured 60 s on 2 cores
def test_a_sweep_whose_driver_is_killed_resumes_with_tuner_restore(head, digits, tmp_path):
    """SIGKILL the driver while trial 1 trains; once Ray has ended the dead driver's trials (their
    ranks are gone: Ray kills a dead job's actors, and a rank dies with its worker), --resume DIR
    finishes the experiment: no trial starts again from step 0, trial 1 continues from its last
    checkpoint. Every trial exists (pending) from the start, so the restored experiment has all three."""
    space = _space(tmp_path, digits, "three.yaml", "grid: {lr: [0.003, 0.002, 0.001]}\n")
    out = tmp_path / "out"
    sweep = ["sweep", "run", str(space), "--engine", "ray", "-np", "2", "--ray-address", head]
    proc = subprocess.Popen([*HVDKIT, *sweep, "--out", str(out)], env=ray_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    log = out / "trials" / "trial-001.log"
    try:
        wait_until(lambda: log.exists() and "epoch 1 loss" in log.read_text(), 400, "trial 1's second epoch")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ranks = [int(p) for f in (out / "trials").glob("trial-*.log") for p in re.findall(r"\d@\w+:(\d+)", f.read_text())]

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    wait_until(lambda: all(gone(p) for p in ranks), 120, "the dead driver's ranks to end")
    assert not (out / "results.json").exists()
    # what a kill during Ray's copy of its state leaves (seen in CI): the searcher's file truncated.
    # Tuner.restore then ran one new trial with an empty config; hvdkit resumes from its own files.
    # (An intact state's Tuner.restore: test_multinode's preempted Ray sweep.)
    searcher = next((out / "tune" / "experiment").glob("basic-variant-state-*.json"))
    searcher.write_bytes(b"")
    resumed = hvdkit(*sweep, "--resume", str(out), timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"WARNING: Ray's saved experiment cannot be restored: {searcher} (empty)" in resumed.stderr
    rows = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in rows] == ["completed"] * 3 and all(r["epochs"] == 3 for r in rows), rows
    for t in range(3):  # each trial trained from step 0 once at most
        assert (out / "trials" / f"trial-{t:03d}.log").read_text().count("start step 0,") <= 1, t
    assert "tune: restored from trial 1's checkpoint" in log.read_text()


@pytest.mark.mp
@pytest.mark.timeout(600)  # measured 30 s on 2 cores
def test_a_trial_that_would_fail_again_is_not_retried(head, digits, tmp_path):
    """#44 class 11: a trial whose loss goes non-finite (exit 65) failed 4 times (--max-failures 2
    plus Tune's own), each from scratch, with Ray tracebacks on a console that exited 0. It now
    ends once, as failed, with the reason; the sweep goes on with the others."""
    space = _space(tmp_path, digits, "nan.yaml", "grid: {lr: [0.002, 1000000.0], optimizer: [sgd]}\n", epochs=2)
    proc = hvdkit("sweep", "run", str(space), "--engine", "ray", "-np", "1", "--ray-address", head,
                  "--out", str(tmp_path / "out"), "--max-failures", "2", timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in rows] == ["completed", "failed"], rows
    error = json.loads((tmp_path / "out" / "results" / "ray-1.json").read_text())["error"]
    assert error.startswith("training diverged (NaN/inf loss or weights) (exit 65"), error
    attempts = sorted(p.name for p in (tmp_path / "out" / "checkpoints" / "trial-001").glob("attempt-*"))
    assert attempts == ["attempt-0"], attempts  # ran once
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_the_ranks_get_the_variables_named_with_x_and_the_default_list():
    """#44 class 11: Ray workers start from the raylet's environment, so HF_HOME, WANDB_MODE or
    TORCH_HOME never reached the ranks; -x NAME passes one on, as mpirun -x does."""
    from hvdkit.rayrun.cluster import worker_env

    shell = {"PATH": "/bin", "HF_HOME": "/data/hf", "WANDB_MODE": "offline", "HVDKIT_X": "1", "SECRET": "s"}
    assert worker_env({}, shell) == {"PATH": "/bin", "HVDKIT_X": "1"}  # the default list only
    assert worker_env({"A": "b"}, shell, forward=("HF_HOME", "WANDB_MODE")) == {
        "PATH": "/bin", "HVDKIT_X": "1", "HF_HOME": "/data/hf", "WANDB_MODE": "offline", "A": "b"}


def test_each_file_tuner_restore_reads_is_checked_before_a_resume(tmp_path):
    """A truncated or garbled Ray state file is named (and so not handed to Tuner.restore, which
    made a trial with an empty config of it); intact ones pass; only the newest of each kind counts."""
    from ray import cloudpickle

    from hvdkit.rayrun.tune import damaged_tune_state

    exp = tmp_path / "experiment"
    exp.mkdir()
    assert damaged_tune_state(exp) == f"{exp / 'tuner.pkl'} (missing)"
    (exp / "tuner.pkl").write_bytes(cloudpickle.dumps({"x": 1}))
    assert damaged_tune_state(exp) is None  # no state yet: Tune's own error covers that
    (exp / "experiment_state-2026-01-01_00-00-00.json").write_text("{}")
    (exp / "basic-variant-state-2026-01-01_00-00-00.json").write_bytes(cloudpickle.dumps({"_iterators": []}))
    assert damaged_tune_state(exp) is None
    older = exp / "experiment_state-2025-01-01_00-00-00.json"
    older.write_text("{")  # an older session's: Ray restores the newest only
    assert damaged_tune_state(exp) is None
    for name, data, why in [("experiment_state-2026-01-01_00-00-00.json", b'{"trial_data": [', "JSONDecodeError"),
                            ("basic-variant-state-2026-01-01_00-00-00.json", b"", "empty)"),
                            ("basic-variant-state-2026-01-01_00-00-00.json", b"\x80\x05K", "UnpicklingError"),
                            ("tuner.pkl", b"", "empty)")]:
        good = (exp / name).read_bytes()
        (exp / name).write_bytes(data)
        found = damaged_tune_state(exp)
        assert found is not None and found.startswith(f"{exp / name} ({why}"), (name, found)
        (exp / name).write_bytes(good)


def test_a_finished_trials_record_is_what_a_resumed_sweep_reports(tmp_path):
    """#44 class 11: a trial whose ranks completed before the driver was lost is reported from
    its metrics file after --resume (hvdkit.rayrun.tune._finished), not trained again."""
    from hvdkit.rayrun.tune import _finished

    path = tmp_path / "ray-0.json"
    assert _finished(path) is None  # none yet
    path.write_text(json.dumps({"status": "completed", "history": [
        {"epoch": 0, "loss": 1.5, "val_accuracy": 0.5}, {"epoch": 1, "loss": 0.5, "val_accuracy": 0.9}]}))
    assert _finished(path) == {"epoch": 1, "loss": 0.5, "val_accuracy": 0.9, "final_loss": 0.5, "epochs": 2}
    path.write_text(json.dumps({"status": "pruned", "history": [{"epoch": 0, "loss": 1.0}]}))  # at a rung
    assert _finished(path) == {"epoch": 0, "loss": 1.0, "final_loss": 1.0, "epochs": 1}
    path.write_text(json.dumps({"status": "failed", "history": [{"epoch": 0, "loss": 1.0}]}))
    assert _finished(path) is None
    path.write_text("{damaged")
    assert _finished(path) is None


def test_find_token_follows_rays_order_and_an_unreadable_path_is_one_line(tmp_path):
    """RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token (what
    'ray get-auth-token' printed for each, checked on Ray 2.60); whitespace is stripped."""
    from hvdkit.errors import ConfigError
    from hvdkit.rayrun.auth import find_token

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("C" * 8 + "\n")
    (tmp_path / "b").write_text("  BBBB \n")
    home = {"HOME": str(tmp_path)}
    assert find_token({**home, "RAY_AUTH_TOKEN": "AAAA", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "b")}) == \
        ("AAAA", "RAY_AUTH_TOKEN")
    assert find_token({**home, "RAY_AUTH_TOKEN": "", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "b")}) == \
        ("BBBB", f"RAY_AUTH_TOKEN_PATH={tmp_path / 'b'}")
    assert find_token(home) == ("C" * 8, str(tmp_path / ".ray" / "auth_token"))
    assert find_token({"HOME": str(tmp_path / "nobody")}) is None
    with pytest.raises(ConfigError, match="RAY_AUTH_TOKEN_PATH=.*missing cannot be read"):
        find_token({**home, "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})


def test_the_wait_names_a_ray_step_that_ended_with_its_logs_cause(tmp_path):
    """A node's 'ray start' that has exited (here: a finished child, reaped or not) ends the
    wait at once, quoting the line of its log that says why."""
    from hvdkit.rayrun.cluster import RayStep, _check_steps, ray_log_cause

    log = tmp_path / "ray-7-node2.out"
    log.write_text("Traceback (most recent call last):\n  File 'x', line 1\n"
                   "FileExistsError: [Errno 17] File exists: '/tmp/ray-7'\n\n")
    assert ray_log_cause(str(log)) == "FileExistsError: [Errno 17] File exists: '/tmp/ray-7'"
    assert ray_log_cause(str(tmp_path / "none")).startswith("(no log:")
    done = subprocess.Popen(["true"])
    wait_until(lambda: open(f"/proc/{done.pid}/stat").read().rpartition(")")[2].split()[0] == "Z", 30,
               "the child to be a zombie")
    alive = subprocess.Popen(["sleep", "60"])
    try:
        _check_steps([RayStep("node1", alive.pid, str(log))], "10.0.0.1:6379")  # running: nothing said
        with pytest.raises(SystemExit) as ended:
            _check_steps([RayStep("node1", alive.pid, str(log)), RayStep("node2", done.pid, str(log))],
                         "10.0.0.1:6379")
    finally:
        alive.kill()
        alive.wait()
        done.wait()
    assert str(ended.value) == ("Error: Ray on node2 exited before the cluster at 10.0.0.1:6379 formed: "
                                f"FileExistsError: [Errno 17] File exists: '/tmp/ray-7' (its whole log: {log})")
