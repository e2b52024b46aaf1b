"""hvdkit run: launch lines as argument lists, dry runs, standalone scripts that really run."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from helpers import PY, base_env
from hvdkit.cli import cli
from hvdkit.launch.local import LocalLaunch, build_local_command, training_program
from hvdkit.launch.output import ConsoleFilter


def test_horovodrun_line():
    argv, env = build_local_command(LocalLaunch(np=2), ["python", "t.py"], environ={})
    assert argv == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "t.py"]


def test_mpirun_line_forwards_only_set_variables_and_oversubscribes():
    spec = LocalLaunch(np=64, launcher="mpirun", env={"NCCL_DEBUG": "INFO"})
    argv, env = build_local_command(spec, ["python", "t.py"], environ={"PATH": "/bin"})
    assert argv[:3] == ["mpirun", "-np", "64"] and "--oversubscribe" in argv
    assert ["-x", "PATH"] == argv[argv.index("-x"):argv.index("-x") + 2]
    assert "LD_LIBRARY_PATH" not in argv and env["NCCL_DEBUG"] == "INFO"


def test_program_or_train_options():
    assert training_program("ddp", ["python", "mine.py"]) == ["python", "mine.py"]
    assert training_program("ddp", ["--epochs", "2"], "py") == ["py", "-m", "hvdkit", "train",
                                                                 "--backend", "ddp", "--epochs", "2"]


def test_dry_run():
    result = CliRunner().invoke(cli, ["run", "-np", "3", "--backend", "ddp", "--dry-run", "--epochs", "2"])
    assert result.exit_code == 0
    assert "mpirun -np 3 -bind-to none -map-by slot" in result.output
    assert "hvdkit train --backend ddp --epochs 2" in result.output
    runner = CliRunner()
    with runner.isolated_filesystem():
        result = runner.invoke(cli, ["run", "--controller", "mpi", "--dry-run", "--", "python", "x y.py"])
        assert "python would run x y.py, which does not exist" in result.output  # found now, not on the nodes
        open("x y.py", "w").close()
        result = runner.invoke(cli, ["run", "--controller", "mpi", "--dry-run", "--", "python", "x y.py"])
    assert "horovodrun -np 2 -H localhost:2 --mpi python 'x y.py'" in result.output


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 5 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_written_script_lints_and_runs(tmp_path, backend):
    script = tmp_path / "launch.sh"
    result = CliRunner().invoke(cli, ["run", "--backend", backend, "--write-script", str(script),
                                      "--model", "tiny", "--epochs", "1", "--num-samples", "128"])
    assert result.exit_code == 0, result.output
    assert subprocess.run(["shellcheck", str(script)]).returncode == 0
    proc = subprocess.run([str(script)], env=base_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"done: backend={backend} world=2" in proc.stdout


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 5 s (2 cores, loaded)
def test_run_executes_and_propagates_exit_code():
    proc = subprocess.run([PY, "-m", "hvdkit", "run", "-np", "2", "--backend", "ddp", "--model", "tiny",
                           "--epochs", "1", "--num-samples", "128"], env=base_env(), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0 and "world=2" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([PY, "-m", "hvdkit", "run", "-np", "2", "--backend", "ddp", "--", PY, "-c",
                           "import sys; sys.exit(3)"], env=base_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0


def test_options_horovodrun_would_swallow_travel_as_environment(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("epochs: 1\n")   # read at generation too: a missing file is refused there
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--model", "tiny", "--timeline", "/t/x.json",
                                      "--fusion-threshold-mb", "4", f"--config={config}", "--stall-check-s", "9"])
    line = result.output
    assert "HVDKIT_TRAIN_TIMELINE=/t/x.json" in line and "HVDKIT_TRAIN_FUSION_THRESHOLD_MB=4" in line
    assert f"HVDKIT_TRAIN_CONFIG={config}" in line and "HVDKIT_TRAIN_STALL_CHECK_S=9" in line
    cmd = line.split("horovodrun", 1)[1]
    assert "--timeline" not in cmd and "--config" not in cmd and "--model tiny" in cmd
    ddp = CliRunner().invoke(cli, ["run", "--backend", "ddp", "--dry-run", "--timeline", "/t/x.json"]).output
    assert "--timeline /t/x.json" in ddp  # mpirun leaves the program's options alone


@pytest.mark.mp
@pytest.mark.timeout(150)  # measured 6 s (2 cores, loaded)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_timeline_written_by_rank0(tmp_path, backend):
    trace = tmp_path / f"{backend}.json"
    proc = subprocess.run([PY, "-m", "hvdkit", "run", "-np", "2", "--backend", backend, "--model", "tiny",
                           "--epochs", "1", "--num-samples", "256", "--timeline", str(trace)],
                          env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = trace.read_text()
    # Horovod's timeline names its allreduces; the torch profiler trace has traceEvents
    assert ("ALLREDUCE" in text or "NEGOTIATE" in text) if backend == "horovod" else '"traceEvents"' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [trace.name]


def test_console_hides_tracebacks_and_the_launchers_kill_of_peers_but_keeps_errors():
    keep = ConsoleFilter()
    lines = ["[1]<stderr>:Traceback (most recent call last):\n",
             '[1]<stderr>:  File "x.py", line 1, in <module>\n',
             "[1]<stderr>:ValueError: boom\n",
             "[0]<stderr>:Error: loss became NaN/inf at step 7 on rank 1\n",
             "[0]<stderr>:Terminated\n",
             "Process 1 exit with status code 1.\n"]
    shown = [line for line in lines if keep(line) is not None]
    # the rank's Error line is kept for the one closing line (RunOutcome.summary), not shown twice
    assert shown == [] and keep.errors == ["Error: loss became NaN/inf at step 7 on rank 1"]
    assert keep.causes == ["ValueError: boom"]
    # with no rank error before it, a kill is news (scancel, the batch system): shown
    assert ConsoleFilter()("[0]<stderr>:Terminated\n") == "[0]<stderr>:Terminated\n"


@pytest.mark.parametrize("line, shown", [
    # rank 0's own program, printed with flush=True: Open MPI tagged the line and its newline
    ("[1,0]<stdout>:epoch 2 val_loss 0.3766[1,0]<stdout>:\n", "epoch 2 val_loss 0.3766\n"),
    ("[0]<stderr>:restored\n", "restored\n"),                         # horovodrun's Gloo tag, rank 0
    ("[1,1]<stdout>:rank one speaks\n", "[1,1]<stdout>:rank one speaks\n"),  # other ranks keep theirs
    ("[1]<stdout>:[hvdkit r1] facts\n", "[hvdkit r1] facts\n"),        # hvdkit's lines name their rank
    ("plain\n", "plain\n"),
])
def test_launcher_tags_are_dropped_where_they_say_nothing(line, shown):
    from hvdkit.launch.output import untagged

    assert untagged(line) == shown


def test_chunks_of_two_ranks_on_one_line_are_put_back_into_each_ranks_lines(tmp_path):
    """#44 class 12: Open MPI tags each chunk as it comes, so rank 0's error ran on into rank 1's
    traceback and its message ended a line later; the closing line held '[1,0]<stderr>:' tags
    and half of two lines. Each rank's text is now held until its own newline."""
    import io

    from hvdkit.launch.output import ConsoleLog, Rejoiner

    r = Rejoiner()
    assert r.feed("[1,0]<stderr>:Error: backend 'Horovod' is not known[1,1]<stderr>:Traceback (most recent "
                  "call last):\n") == ["[1,1]<stderr>:Traceback (most recent call last):\n"]
    assert r.feed("[1,0]<stderr>: HINT: use one of: horovod\n") == [
        "[1,0]<stderr>:Error: backend 'Horovod' is not known HINT: use one of: horovod\n"]
    assert r.feed("[1,0]<stdout>:epoch 2[1,0]<stdout>:\n") == ["[1,0]<stdout>:epoch 2\n"]  # a flushed newline
    assert r.feed("plain\n") == ["plain\n"] and r.feed("[rank0]: torch's\n") == ["[rank0]: torch's\n"]
    assert r.feed("[1,1]<stderr>:unfinished") == ["[1,1]<stderr>:unfinished"] and r.flush() == []
    assert r.feed("[1,0]<stderr>:half[1,1]<stderr>:x\n") == ["[1,1]<stderr>:x\n"]
    assert r.flush() == ["[1,0]<stderr>:half\n"]
    # through the console: one closing line, no tags in it, no traceback shown
    err = io.StringIO()
    console = ConsoleLog(str(tmp_path), out=io.StringIO(), err=err)
    for line in ["[1,1]<stderr>:Traceback (most recent call last):\n",
                 "[1,1]<stderr>:  File \"own.py\", line 3, in <module>\n",
                 "[1,1]<stderr>:hvdkit.errors.ConfigError[1,0]<stderr>:Traceback (most recent call last):\n",
                 "[1,0]<stderr>:  File \"own.py\", line 3, in <module>\n",
                 "[1,1]<stderr>:: backend 'Horovod' is not known\n",
                 "[1,0]<stderr>:hvdkit.errors.ConfigError: backend 'Horovod' is not known\n"]:
        console.feed(line)
    closing = console.close(1).closing_line()
    assert closing.startswith("Error: job failed (exit 1): hvdkit.errors.ConfigError: backend 'Horovod' is not "
                              "known [full output: ") and "<stderr>" not in closing, closing
    assert err.getvalue() == "", err.getvalue()


@pytest.mark.mp
@pytest.mark.timeout(300)  # measured 12 s (2 cores)
@pytest.mark.parametrize("backend", ["horovod", "ddp"])
def test_a_failure_on_every_rank_is_one_error_line(tmp_path, backend):
    """Each rank said the same 'Error: ...' and hvdkit run its summary under them: three lines of
    the same words. Now the ranks' lines go to the log and the summary is the one line."""
    (tmp_path / "f.py").write_text("def boom():\n    raise RuntimeError('no GPU')\n")
    subprocess.run([PY, "-m", "hvdkit", "data", "make-synthetic", str(tmp_path / "d.h5"), "--model", "tiny",
                    "--num-samples", "64"], env=base_env(), check=True, capture_output=True, timeout=120)
    proc = subprocess.run([PY, "-m", "hvdkit", "run", "-np", "2", "--backend", backend, "--log-dir", str(tmp_path),
                           "--", "--model", f"{tmp_path}/f.py:boom", "--data", str(tmp_path / "d.h5")], env=base_env(),
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith(f"Error: job failed (exit 1): --model {tmp_path}/f.py:boom() raised RuntimeError: "
                                "no GPU") and "[full output: " in errors[0]
    log = errors[0].rsplit("[full output: ", 1)[1].rstrip("]")
    assert open(log).read().count("raised RuntimeError: no GPU") >= 2  # every rank's line is in the log


def test_a_preempted_run_says_so_with_its_step_not_job_failed(tmp_path):
    """Exit 75 is 'preempted, not requeued' (README): the closing line says what happened, at which
    step, and how to resume, instead of 'Error: job failed (exit 75)'."""
    from hvdkit.launch.output import RunOutcome

    keep = ConsoleFilter()
    for line in ("[0]<stdout>:[hvdkit] epoch 0 loss 1.2\n",
                 "[0]<stdout>:[hvdkit] preempted at step 57 by SIGUSR1; checkpoint saved; not requeued\n"):
        keep(line)
    outcome = RunOutcome(75, tmp_path / "log", keep.errors, keep.causes, keep.preempted_at)
    assert outcome.closing_line() == ("preempted (exit 75): the ranks saved a checkpoint at step 57 and stopped, not "
                                      "requeued; run the same command again to resume from it")
    assert RunOutcome(1, tmp_path / "log", ["Error: boom"], []).closing_line().startswith("Error: job failed (exit 1)")


def test_a_failed_job_keeps_its_log_unless_it_printed_nothing(tmp_path):
    """A failed job's log is kept and named; one that printed nothing leaves no empty file."""
    import io

    from hvdkit.launch.output import ConsoleLog

    said = ConsoleLog(str(tmp_path), out=io.StringIO(), err=io.StringIO())
    said.feed("[0]<stderr>:Error: boom\n")
    outcome = said.close(1)
    assert outcome.log is not None and outcome.log.read_text() == "[0]<stderr>:Error: boom\n"
    assert outcome.summary().endswith(f"[full output: {outcome.log}]")
    outcome.log.unlink()
    silent = ConsoleLog(str(tmp_path), out=io.StringIO(), err=io.StringIO()).close(1)
    assert silent.log is None and list(tmp_path.iterdir()) == []
    assert silent.summary() == "job failed (exit 1): the launcher exited with status 1 [it printed nothing]"
