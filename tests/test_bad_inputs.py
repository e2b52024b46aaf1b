"""Hostile input, table-driven: every mistake is refused at once, in at most 3 lines, writing nothing.

Each row is one command a user might type, the exit status it must end with (2 = usage,
caught before anything runs; 1 = found at run time), and words the message must hold.

Each row is a real ``python -m hvdkit`` process (a traceback or a stray line shows only
there), run in its own copy of the input files so that "writes nothing" is checked per row.
The rows are started ahead on a small pool of threads as soon as the module's first test asks
(a process is mostly interpreter start-up on one core; on 2 cores two at once halve the
table's time) and each test waits for its own row only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor

import click
import h5py
import numpy as np
import pytest

from helpers import HVDKIT, base_env

CASES = [
    # hvdkit slurm: all caught when the script is generated
    ("slurm -o x.sbatch --array 5-2", 2, "runs backwards"),
    ("slurm -o x.sbatch --array 0-2 --array-params missing.txt", 2, "missing.txt"),
    ("slurm -o x.sbatch --array 0-2 --array-params one-line.txt", 2, "has 1 line(s) but --array 0-2 needs 3"),
    ("slurm -o x.sbatch --array 0-4%0", 2, "--array"),
    ("slurm -o x.sbatch -- --bogus-flag", 2, "no such option --bogus-flag"),
    ("slurm -o x.sbatch --mem lots -- --epochs 1", 2, "--mem 'lots' is not a Slurm memory size"),
    ("slurm -o x.sbatch --mem 1M -- --model mlp --epochs 1", 2, "--mem 1M: a rank needs at least"),
    ("slurm -o x.sbatch -- --lr abc", 2, "'--lr': 'abc'"),
    ("slurm -o x.sbatch -- --epochs -1", 2, "--epochs"),
    ("slurm -o x.sbatch --ntasks-per-node 2", 2, "use hvdkit's --tasks-per-node"),
    ("slurm -o x.sbatch --tasks-per-nod 2", 2, "did you mean 'hvdkit slurm --tasks-per-node'"),
    ("slurm -o x.sbatch --backend ddp --srun-mpi pmix", 2, "--srun-mpi pmix with --backend ddp"),
    ("slurm -o x.sbatch --nodes 0", 2, "--nodes"),
    ("slurm -o x.sbatch --time 99:99:99:99", 2, "is not a Slurm time limit"),
    ("slurm -o x.sbatch --backend mxnet", 2, "'mxnet' is not one of"),
    ("slurm -o x.sbatch -- noexec.py --epochs 1", 2, "noexec.py"),
    ("slurm -o x.sbatch -- ./missing.py", 2, "does not exist"),
    ("slurm -o x.sbatch -- python /nonexistent/train.py", 2, "python would run /nonexistent/train.py, which does not"),
    ("slurm -o x.sbatch -- --model nosuchpkg.models:net --data tiny.h5", 2,
     "module nosuchpkg.models cannot be found here"),
    ("slurm -o x.sbatch -- --model factories.py:linear --model-arg widht=4 --data tiny.h5", 2,
     "takes no argument 'widht'"),
    ("slurm -o x.sbatch -- --model missing.py:net --data tiny.h5", 2, "file missing.py does not exist"),
    ("slurm -o x.sbatch -- --model factories.py:nope --data tiny.h5", 2, "factories.py defines no 'nope'"),
    ("slurm -o x.sbatch -- --lr nan", 2, "Invalid value for '--lr': 'nan' is not a finite number"),
    ("slurm -o x.sbatch -- --backend ddp --ddp-timeout 1e-9", 2,
     "'--ddp-timeout': 1e-09 is not in the range finite, x>=1"),
    ("slurm -o x.sbatch -- --compression powersgd:rank=0", 2, "--compression powersgd:rank=0: rank must be >= 1"),
    ("slurm -o x.sbatch -- --compression powersgd --elastic", 2, "--compression powersgd cannot be combined "
     "with --elastic"),
    ("slurm -o x.sbatch --fusion-threshold-mb nan -- --model tiny", 2, "'nan' is not a finite number"),
    ("slurm -o x.sbatch -- --model syntax.py:net --data tiny.h5", 2, "syntax.py line 1: SyntaxError"),
    ("slurm -o x.sbatch -- --optimizer factories.py:NeedsArg", 2,
     "--optimizer factories.py:NeedsArg needs 'required_thing', which nothing passes"),
    ("slurm -o x.sbatch -- --keep-best val_f1 --checkpoint-dir ck --val-fraction 0.2", 2,
     "--keep-best val_f1 is never produced: the classification task's epochs report loss, samples_per_sec, "
     "comm_wait, val_loss, val_accuracy"),
    # hvdkit run: refused before any launcher starts
    ("run -np 0", 2, "'-np' / '--np'"),
    ("run --iface nosuch0 -- --epochs 1", 2, "network interface 'nosuch0'"),
    ("run --elastic -- --epochs 1", 2, "--elastic needs --host-discovery-script"),
    ("run -- --lrr 0.1", 2, "did you mean --lr?"),
    ("run -- ./missing.py", 2, "does not exist"),
    ("run -- --model torch.nn:Linear --model-arg in_features=8 --model-arg bogus=1 --data tiny.h5", 2,
     "--model torch.nn:Linear takes no argument 'bogus'"),
    ("run -- --val-fraction 1.5", 2, "--val-fraction must be in [0, 1)"),
    ("run -- --lr nan", 2, "Invalid value for '--lr': 'nan' is not a finite number"),
    ("run -H node1:x --dry-run -- --epochs 1", 2, "'node1:x' is not host:slots"),
    ("run -H node1:0 --dry-run -- --epochs 1", 2, "'node1:0' is not host:slots with slots >= 1"),
    ("run --elastic --host-discovery-script two-slots.sh --min-np 3 -np 2", 2, "need --min-np (3) <= -np (2)"),
    ("run --elastic --host-discovery-script one-slot.sh --min-np 2 -np 2 -- --epochs 1", 2,
     "lists 1 slot(s) (localhost:1), but --min-np 2 needs that many"),
    ("run --elastic --host-discovery-script garbage.sh -- --epochs 1", 2, "printed 'node1:two', not host:slots"),
    ("run --elastic --host-discovery-script noexec.py -- --epochs 1", 2, "is not executable"),
    ("run --elastic --controller mpi --host-discovery-script two-slots.sh -- --epochs 1", 2,
     "--controller mpi cannot run elastic training"),
    # hvdkit train: bad options, bad data (before the first step)
    ("train --lr -1", 2, "'--lr'"),
    ("train --lr nan", 2, "Invalid value for '--lr': 'nan' is not a finite number"),
    ("train --compression powersgd:rank=x", 2, "--compression powersgd:rank=x: rank must be an integer"),
    ("train --compression powersgd:start=1", 2, "start must be >= 2, got 1"),
    ("train --compression powersgd:ranks=2", 2, "'ranks=2' is not an option of powersgd"),
    ("train --compression fp16:rank=2", 2, "fp16 takes no options"),
    ("train --compression int8", 2, "--compression 'int8' is not known"),
    ("train --compression powersgd --shard optimizer", 2, "--shard optimizer cannot be combined with "
     "--compression powersgd"),
    ("train --backend horovod --compression powersgd --hvd-reducer stock", 2,
     "--compression powersgd cannot be combined with --hvd-reducer stock"),
    ("run -- --compression powersgd:rank=0", 2, "rank must be >= 1, got 0"),
    ("train --model resnet", 2, "--model 'resnet' is not known"),
    ("train --val-fraction 1.5", 2, "--val-fraction must be in [0, 1), got 1.5"),
    ("train --eval-every 5", 2, "--eval-every needs validation data"),
    ("train --keep-best val_loss --checkpoint-dir ck", 2, "--keep-best val_loss needs validation data"),
    ("train --keep-best foo --checkpoint-dir ck --val-fraction 0.2", 2, "--keep-best foo is never produced"),
    ("train --keep-best accuracy --checkpoint-dir ck --val-fraction 0.2", 2, "--keep-best accuracy is never produced"),
    ("train --keep-best val_perplexity --checkpoint-dir ck --val-fraction 0.2", 2,
     "--keep-best val_perplexity is never produced"),
    ("train --model-arg width", 2, "--model-arg 'width' is not KEY=VALUE"),
    ("train --momentum -1", 2, "momentum must be >= 0, got -1.0"),
    ("train --lr-decay-steps 5", 2, "--lr-decay-steps sets the cosine schedule's length, and --lr-schedule is"),
    ("train --optimizer-arg lr=0.5", 2, "--optimizer-arg lr: --optimizer sgd gets lr from --lr"),
    ("train --optimizer-arg bogus=1", 2, "--optimizer sgd refused --optimizer-arg bogus=1: TypeError"),
    ("train --optimizer-arg eps=abc", 2, "--optimizer sgd refused --optimizer-arg eps=abc"),
    ("train --optimizer adam --optimizer-arg betas=[0.9]", 2, "--optimizer adam refused --optimizer-arg betas=[0.9]"),
    ("train --num-workers 10000", 2, "--num-workers 10000 is more than 64 DataLoader processes for one rank"),
    ("slurm -o x.sbatch -- --num-workers 10000", 2, "--num-workers 10000 is more than 64"),
    # every path the run writes is found writable before it starts, not after the training
    ("train --metrics-file /proc/x.json", 2, "--metrics-file /proc/x.json cannot be written: /proc"),
    ("train --tensorboard /proc/x", 2, "--tensorboard /proc/x cannot be written"),
    ("train --sample-log /proc/x.jsonl", 2, "--sample-log /proc/x.jsonl cannot be written"),
    ("train --checkpoint-dir one-line.txt/ck", 2, "one-line.txt is a file, not a directory"),
    ("train --metrics-file .", 2, "is a directory"),
    ("run --dry-run -- --timeline /proc/t.json", 2, "--timeline /proc/t.json cannot be written"),
    ("slurm -o x.sbatch -- --tensorboard /proc/x", 2, "--tensorboard /proc/x cannot be written"),
    ("train --model tiny --model-arg width=4", 2, "--model tiny takes no argument 'width'"),
    # your own model and data: a path that does not import, a factory that raises, an argument it
    # lacks, an output that does not fit the labels, data that does not fit the model
    ("train --model nosuchpkg.models:net --data tiny.h5", 2, "importing nosuchpkg.models failed: ModuleNotFoundError"),
    ("train --model factories.py:nope --data tiny.h5", 2, "factories.py has no attribute 'nope'"),  # not hvdkit_user_
    ("train --model factories.py:noparams --data tiny.h5", 1, "has nothing to train: it has no parameters"),
    ("train --model factories.py:frozen --data tiny.h5", 1, "all its 2 parameter tensors are frozen"),
    ("train --dataset factories.py:none_data --model factories.py:linear", 1, "returned None as the training data"),
    ("train --model factories.py:exits --data tiny.h5", 1, "--model factories.py:exits called sys.exit(3)"),
    ("train --model exit4.py:net --data tiny.h5", 2, "importing exit4.py called sys.exit(4)"),
    ("train --model factories.py:boom --data tiny.h5", 1, "factories.py:boom() raised RuntimeError: no GPU"),
    ("train --model factories.py:linear --model-arg widht=4 --data tiny.h5", 2,
     "takes no argument 'widht'"),
    ("train --model factories.py:linear --model-arg outputs=2 --data tiny.h5", 1,
     "label 3 (sample 0) does not fit the model's 2 outputs"),
    ("train --model factories.py:linear --model-arg inputs=5 --data tiny.h5", 1,
     "training data does not fit --model factories.py:linear: the first batch raised RuntimeError: "
     "mat1 and mat2 shapes cannot be multiplied"),
    ("train --model factories.py:linear --model-arg inputs=5", 2, "needs data: synthetic data exists only"),
    ("run -np 2 -- --model factories.py:linear --val-fraction 0.2", 2, "needs data: synthetic data exists only"),
    ("train --model factories.py:linear --data tiny.h5 --task language-model", 1,
     "language-model inputs must be integer token ids"),
    ("train --optimizer torch.optim:RMSprop --optimizer-arg alfa=0.9", 2, "takes no argument 'alfa'"),
    ("train --dataset factories.py:not_a_dataset --model factories.py:linear", 1,
     "gave a int as training data, not a map-style Dataset"),
    ("train --config missing.yaml", 2, "cannot read missing.yaml"),
    ("train --global-batch-size 3 --exact-batch --accumulation-steps 2", 1, "does not divide"),
    ("train --data missing.h5", 1, "does not exist"),
    ("train --data one-line.txt --model tiny", 1, "not an HDF5 file"),
    ("train --data tiny.h5 --model mlp", 1, "model mlp expects (64,)"),
    ("train --data badlabel.h5 --model tiny", 1, "'y'[3] = 99 is outside model tiny's 4 classes"),
    ("train --data float64.h5 --model tiny", 1, "has dtype float64, expected float32"),
    ("train --data nokeys.h5 --model tiny", 1, "no dataset 'x'"),
    ("train --data tiny.h5 --val-data nokeys.h5 --model tiny", 1, "nokeys.h5: no dataset 'x'"),
    ("train --data tiny.h5 --val-data nan.h5 --model tiny --epochs 1", 1,
     "validation loss = nan at step 2 while training is finite: the validation data (nan.h5) likely holds NaN/inf"),
    # hvdkit ckpt / data / sweep / bench
    ("ckpt show missing.h5", 1, "does not exist"),
    ("ckpt show one-line.txt", 1, "damaged header or is not a checkpoint"),
    ("ckpt show damaged.h5", 1, "is corrupt: "),
    ("ckpt verify damaged.h5", 1, "FAILED"),
    ("ckpt show .", 1, "has no 'latest' checkpoint pointer"),
    ("data check badlabel.h5 --model tiny", 1, "is outside model tiny's"),
    ("data check nan.h5", 1, "'x'[5] holds NaN/inf"),
    ("data make-synthetic /proc/x.h5", 1, "make-synthetic /proc/x.h5 cannot be written"),
    ("data make-synthetic out.h5 --num-samples 0", 2, "--num-samples"),
    # a file hvdkit is told to write goes into a directory that exists: none is created for a typo
    ("data make-synthetic /nonexistent/dir/x.h5", 1, "the directory /nonexistent/dir does not exist"),
    ("slurm -o /nonexistent/dir/x.sbatch", 2, "-o /nonexistent/dir/x.sbatch: the directory /nonexistent/dir does not"),
    ("run --write-script /nonexistent/dir/x.sh -- --epochs 1", 2, "the directory /nonexistent/dir does not exist"),
    ("sweep", 2, "Missing argument 'SPACE'"),
    ("sweep badspace.yaml", 2, "exactly one of 'grid' or 'random'"),
    ("sweep unknown-key.yaml", 2, "unknown key(s) in unknown-key.yaml: search"),
    ("sweep empty-grid.yaml", 2, "grid: lr must be a non-empty list of values"),
    ("sweep bad-mode.yaml", 2, "mode 'best' is not min or max"),
    ("sweep broken.yaml", 2, "cannot read sweep space broken.yaml"),
    ("sweep status .", 1, "holds no sweep"),
    ("sweep badspace.yaml --slurm --backend local", 2, "runs one plain process"),
    ("bench --bogus", 2, "No such option"),
    # hvdkit bench: every value checked before anything is measured, and no results directory
    ("bench --models bogus", 2, "--models: bogus is not a model the reducer/ab/fusion/scaling/model experiments"),
    ("bench --only paths --models gpt,tiny", 2, "--models: tiny is not a model of the paths experiment"),
    ("bench --only paths --paths bogus", 2, "unknown: bogus"),
    ("bench --sizes abc", 2, "'abc' in 'abc' is not a number"),
    ("bench --sizes 1e400", 2, "'1e400' in '1e400' is not a number"),
    ("bench --sizes 4096,-5", 2, "--sizes 4096,-5: each value must be a finite number >= 1 byte"),
    ("bench --world-sizes 1,0", 2, "--world-sizes 1,0: each value must be a finite number >= 1"),
    ("bench --fusion-mb 1,two", 2, "'two' in '1,two' is not a number"),
    ("bench --cycle-ms 0", 2, "--cycle-ms 0: each value must be a finite number > 0"),
    ("bench --only allreduce,model --sizes 4096", 2, "the cost model (--only model) is fitted to the allreduce"),
    ("bench --only model", 2, "run it with --only allreduce,model and at least two --sizes"),
    # every command that writes a file or a directory: checked before anything runs (#44 item 5)
    ("train --model tiny --metrics-file /dev/null", 2, "--metrics-file /dev/null is a character device, not a file"),
    ("slurm -o /dev/null -- --model tiny", 2, "-o /dev/null is a character device, not a file"),
    ("run --write-script /dev/null -np 2 -- --model tiny", 2, "--write-script /dev/null is a character device"),
    ("ckpt export damaged.h5 /dev/null", 1, "OUT /dev/null is a character device"),
    ("train --model tiny --metrics-file " + "m" * 300 + ".json", 2, "bytes, more than a file system takes"),
    ("run --write-script /proc/x.sh -np 2 -- --model tiny", 2, "--write-script /proc/x.sh cannot be written"),
    ("run --write-discovery-script /proc/x.sh", 2, "--write-discovery-script /proc/x.sh cannot be written"),
    ("run --log-dir /proc -np 2 -- --model tiny", 2, "--log-dir /proc cannot be written"),
    ("slurm --engine ray -o /proc/x.sbatch -- --model tiny", 2, "-o /proc/x.sbatch cannot be written"),
    ("sweep ok-space.yaml --out /proc/sw", 2, "--out /proc/sw cannot be written"),
    ("bench --out /proc/b", 2, "--out-dir /proc/b cannot be written"),
    ("data import-digits /proc/d", 2, "DIRECTORY /proc/d cannot be written"),
    ("data import-text /proc/d", 2, "DIRECTORY /proc/d cannot be written"),
    # an option the chosen backend would ignore (#44 item 6)
    ("slurm -o x.sbatch --backend ddp -- --hvd-reducer stock", 2,
     "--hvd-reducer is an option of --backend horovod; --backend ddp would ignore it"),
    ("run --dry-run --backend horovod -- --ddp-timeout 60", 2, "--ddp-timeout is an option of --backend ddp"),
    ("train --backend local --compression fp16 --model tiny", 2, "--compression with --backend local"),
    # hvdkit plot: nothing to draw, or nowhere to draw it; never an empty or misnamed figure
    ("plot nohistory.json", 1, "nohistory.json holds no finished epoch"),
    ("plot badloss.json", 1, "badloss.json: history record 0 has no numeric 'loss'"),
    ("plot good.json -o pfile", 1, "-o pfile: the figure's format comes from its suffix, and none is not one of"),
    ("plot good.json -o p.xyz", 1, ".xyz is not one of .png, .svg, .pdf"),
    ("plot good.json -o /nonexistent/dir/x.png", 1, "the directory /nonexistent/dir does not exist"),
    ("plot good.json -o /proc/x.png", 1, "-o /proc/x.png cannot be written"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files the bad commands point at, made once; each test copies nothing and must add nothing."""
    from hvdkit.checkpoint import Snapshot, write_checkpoint
    from hvdkit.data import make_synthetic_h5
    from hvdkit.models import build_model

    d = tmp_path_factory.mktemp("inputs")
    (d / "one-line.txt").write_text("--lr 0.1\n")
    (d / "noexec.py").write_text("print('hi')\n")
    (d / "factories.py").write_text(
        "import torch\n\n"
        "def boom():\n    raise RuntimeError('no GPU')\n\n"
        "def linear(inputs=8, outputs=4):\n    return torch.nn.Linear(inputs, outputs)\n\n"
        "def not_a_dataset():\n    return 3\n\n"
        "def noparams():\n    return torch.nn.ReLU()\n\n"
        "def frozen():\n    return torch.nn.Linear(8, 4).requires_grad_(False)\n\n"
        "def none_data():\n    return None\n\n"
        "def exits():\n    import sys\n    sys.exit(3)\n\n"
        "class NeedsArg(torch.optim.SGD):\n    def __init__(self, params, lr, required_thing):\n"
        "        super().__init__(params, lr=lr)\n")
    (d / "syntax.py").write_text("def net(:\n    pass\n")
    (d / "exit4.py").write_text("import sys\nsys.exit(4)\n")
    (d / "badspace.yaml").write_text("metric: final_loss\nfixed: {model: tiny}\n")
    (d / "unknown-key.yaml").write_text("grid: {lr: [0.1]}\nsearch: random\n")
    (d / "empty-grid.yaml").write_text("grid: {lr: []}\n")
    (d / "ok-space.yaml").write_text("grid: {lr: [0.1]}\nfixed: {model: tiny, epochs: 1}\n")
    (d / "bad-mode.yaml").write_text("mode: best\ngrid: {lr: [0.1]}\n")
    (d / "broken.yaml").write_text("grid: {lr: [0.1\n")
    (d / "nohistory.json").write_text('{"history": []}')
    (d / "badloss.json").write_text('{"history": [{"epoch": 0, "step": 1, "loss": "abc"}]}')
    (d / "good.json").write_text('{"history": [{"epoch": 0, "step": 1, "loss": 1.0}]}')
    for name, text in (("two-slots.sh", "localhost:2"), ("one-slot.sh", "localhost:1"), ("garbage.sh", "node1:two")):
        (d / name).write_text(f"#!/bin/sh\necho {text}\n")
        (d / name).chmod(0o755)
    make_synthetic_h5(d / "tiny.h5", "tiny", 64)
    for name, edit in (("badlabel.h5", lambda f: f["y"].__setitem__(3, 99)),
                       ("nan.h5", lambda f: f["x"].__setitem__(5, np.full(8, np.nan, np.float32)))):
        make_synthetic_h5(d / name, "tiny", 64)
        with h5py.File(d / name, "r+") as f:
            edit(f)
    with h5py.File(d / "float64.h5", "w") as f:
        f["x"], f["y"] = np.zeros((4, 8)), np.zeros(4, dtype=np.int64)
    with h5py.File(d / "nokeys.h5", "w") as f:
        f["images"] = np.zeros((4, 8), np.float32)
    ckpt = write_checkpoint(d / "damaged.h5", Snapshot(states={"model": build_model("tiny").state_dict()}))
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x40
    ckpt.write_bytes(bytes(data))
    return d


def _refuse(inputs, workdir, command: str) -> tuple[subprocess.CompletedProcess, list[str], list[str]]:
    """Run one row in a fresh copy of ``inputs``: the process, and the copy's listing before and after."""
    shutil.copytree(inputs, workdir)
    before = sorted(p.name for p in workdir.iterdir())
    proc = subprocess.run([*HVDKIT, *command.split()], cwd=workdir, env=base_env(), capture_output=True,
                          text=True, timeout=120)
    return proc, before, sorted(p.name for p in workdir.iterdir())


@pytest.fixture(scope="module")
def refusals(inputs, tmp_path_factory, request):
    """The selected rows' outcomes, started at once on min(4, cores) threads; a test waits for its own."""
    root = tmp_path_factory.mktemp("rows")
    selected = {item.callspec.params["command"] for item in request.session.items
                if getattr(item, "callspec", None) and "command" in item.callspec.params}
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        futures: dict[str, Future] = {command: pool.submit(_refuse, inputs, root / str(i), command)
                                      for i, (command, _, _) in enumerate(CASES) if command in selected}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.timeout(400)  # measured 3-11 s a row, 84 s for the whole table (2 AVX2 cores); a hang guard
@pytest.mark.parametrize("command,code,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_short_error_and_writes_nothing(refusals, command, code, words):
    proc, before, after = refusals[command].result(timeout=390)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert 1 <= len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr
    assert words in proc.stdout + proc.stderr
    assert after == before, "a refused command wrote a file"


@pytest.mark.parametrize("command", ["run --dry-run -np 2 --backend ddp", "slurm -o x.sbatch",
                                     "run --write-script x.sh"])
def test_training_values_from_the_environment_are_checked_when_the_command_is_made(command, tmp_path):
    """HVDKIT_TRAIN_* reach the ranks as options (click's auto_envvar_prefix): a bad one is
    refused, named, before a script is written or a job starts (#44 item 7)."""
    for variable, value, words in (("HVDKIT_TRAIN_LR", "abc", "Invalid value for '--lr'"),
                                   ("HVDKIT_TRAIN_EPOCHS", "0", "Invalid value for '--epochs'"),
                                   ("HVDKIT_TRAIN_MODEL", "missing.py:net", "--model missing.py:net")):
        proc = subprocess.run([*HVDKIT, *command.split(), "--", "--epochs", "1"] if variable != "HVDKIT_TRAIN_EPOCHS"
                              else [*HVDKIT, *command.split(), "--"], cwd=tmp_path,
                              env=base_env(**{variable: value}), capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (variable, proc.stderr)
        assert variable in lines[0] and words in lines[0], lines  # named: the command line does not show it
        assert not list(tmp_path.iterdir()), "a refused command wrote a file"


def test_every_option_of_one_backend_given_for_another_is_refused_when_the_script_is_made():
    """#44 item 6: an option only one backend reads (BACKEND_ONLY, which build_train_config
    follows) is one usage error under any other backend, at generation, naming both; under
    its own backend it is accepted. The walk covers each such option of 'hvdkit train'."""
    import click

    from hvdkit.cli.train_cmd import BACKEND_ONLY, train_command
    from hvdkit.cli.validate import check_train_args

    params = {p.name: p for p in train_command.params}
    for owner, names in BACKEND_ONLY.items():
        for name in names:
            param = params[name]
            value = [] if param.is_flag else [param.type.choices[-1]] if isinstance(param.type, click.Choice) \
                else ["2"]
            given = [param.opts[0], *value]
            check_train_args(given, backend=owner)  # its own backend takes it
            for other in ("horovod", "ddp", "local"):
                if other == owner:
                    continue
                with pytest.raises(click.UsageError) as info:
                    check_train_args(given, backend=other)
                said = info.value.format_message()
                assert f"{param.opts[0]} is an option of --backend {owner}; --backend {other} would ignore it" \
                    in said and "\n" not in said, said


def test_dev_null_stays_a_device_whatever_is_refused():
    """As root, one atomic write to --metrics-file /dev/null would have replaced the device."""
    import stat

    proc = subprocess.run([*HVDKIT, "train", "--model", "tiny", "--epochs", "1", "--metrics-file", "/dev/null"],
                          env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and stat.S_ISCHR(os.stat("/dev/null").st_mode), proc.stderr


def test_no_directory_is_created_for_a_mistyped_output_path():
    import os

    assert not os.path.exists("/nonexistent"), "a command created /nonexistent (or something else did)"


def test_slurm_warns_about_a_venv_missing_here_but_still_writes_the_script(tmp_path):
    """The cluster's file system may differ from the login node's: a warning, not a refusal."""
    out = tmp_path / "x.sbatch"
    proc = subprocess.run([*HVDKIT, "slurm", "--venv", "/nonexistent/venv", "-o", str(out), "--", "--epochs", "1"],
                          cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and out.exists(), proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("Warning:")]
    assert len(warning) == 1 and "--venv /nonexistent/venv has no bin/activate on this machine" in warning[0]
    assert "file system may differ" in warning[0]
    assert "source /nonexistent/venv/bin/activate" in out.read_text()


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_no_number_option_of_train_takes_nan_or_inf(bad):
    """Every float option of 'hvdkit train' (its range checks alone let nan through): one line,
    exit 2, before anything runs. The walk finds the options itself, so a new one is covered."""
    from click.testing import CliRunner

    from hvdkit.cli import cli
    from hvdkit.cli.train_cmd import FiniteFloat, train_command

    floats = [p for p in train_command.params if isinstance(p.type, FiniteFloat)]
    assert len(floats) >= 14 and not [p.name for p in train_command.params
                                      if isinstance(p.type, click.FloatRange) and p not in floats]
    for param in floats:
        result = CliRunner().invoke(cli, ["train", param.opts[0], bad])
        assert result.exit_code == 2, (param.opts[0], result.output[-500:])
        said = [line for line in result.output.splitlines() if line.startswith("Error:")]
        # "'nan' is not a finite number", or for +-inf outside a range "inf is not in the range finite, x>0"
        assert len(said) == 1 and f"Invalid value for '{param.opts[0]}': " in said[0] and "finite" in said[0], said


# #44 item 6, the rest of the class: options that the other choices of the same command would
# ignore. Each is refused in one line naming it, before anything starts or is written; the
# same option in its own setting is accepted (the second half of each row, where one is cheap).
IGNORED = [
    ("run --dry-run --ray-address 127.0.0.1:1 -- --epochs 1", "--ray-address places ranks on Ray"),
    ("run --dry-run -c 2 -- --epochs 1", "--cpus-per-task places ranks on Ray"),
    ("run --dry-run --ray-placement pack -- --epochs 1", "--ray-placement places ranks on Ray"),
    ("run --dry-run -x HOME -- --epochs 1", "-x places ranks on Ray"),
    ("run --launcher ray --controller gloo -- --epochs 1", "--controller is an option of horovodrun and mpirun"),
    ("run --launcher ray --oversubscribe -- --epochs 1", "--oversubscribe is an option of horovodrun and mpirun"),
    ("run --dry-run --backend ddp --launcher mpirun --controller gloo -- --epochs 1", "mpirun is MPI"),
    ("run --dry-run --min-np 1 -- --epochs 1", "--min-np is an option of --elastic"),
    ("run --dry-run --max-np 4 -- --epochs 1", "--max-np is an option of --elastic"),
    ("run --dry-run --elastic-timeout 60 -- --epochs 1", "--elastic-timeout is an option of --elastic"),
    ("run --dry-run --slots 4 -- --epochs 1", "--slots sizes the script of --write-discovery-script"),
    ("run --launcher ray --elastic -- --epochs 1", "--elastic cannot be combined with --launcher ray"),
    ("run --launcher ray -- --epochs 1 --elastic", "training's --elastic needs Horovod Elastic's driver"),
    ("slurm --engine ray -- --epochs 1 --elastic", "training's --elastic needs Horovod Elastic's driver"),
    ("slurm --engine ray --srun-mpi pmix -- --epochs 1", "--srun-mpi cannot be combined with --engine ray"),
    ("slurm --backend ddp --process-group nccl -- --epochs 1", "--process-group nccl needs GPUs"),
    ("slurm --engine ray --backend ddp --process-group nccl -- --epochs 1", "--process-group nccl needs GPUs"),
    ("slurm --backend horovod --process-group gloo -- --epochs 1", "--process-group is DDP's"),
    ("sweep space.yaml --ray-address 127.0.0.1:1", "--ray-address is an option of --engine ray"),
    ("sweep space.yaml --max-failures 1", "--max-failures is an option of --engine ray"),
    ("sweep space.yaml --gpus-per-task 1", "--gpus-per-task is an option of --engine ray"),
    ("sweep space.yaml --eta 3", "--eta is an option of scheduler: asha; this sweep's scheduler is none"),
    ("sweep space.yaml --grace 2", "--grace is an option of scheduler: asha"),
    ("sweep space.yaml --engine ray --scheduler pbt --eta 3", "this sweep's scheduler is pbt"),
    ("sweep space.yaml --max-parallel 2", "--max-parallel is an option of --slurm"),
    ("sweep space.yaml --engine ray --slurm --max-parallel 2", "--max-parallel throttles a job array"),
    ("sweep space.yaml --venv /x", "--venv is an option of --slurm"),
    ("sweep space.yaml -t 1:00", "--time is an option of --slurm"),
    ("train --optimizer adam --momentum 0.5", "--momentum is --optimizer sgd's; --optimizer adam takes no momentum"),
    ("train --optimizer torch.optim:SGD --momentum 0.9 --optimizer-arg momentum=0.5",
     "--optimizer torch.optim:SGD is given only --optimizer-arg values"),
    ("train --optimizer adam --optimizer-arg amsgrad=maybe", "takes true or false for amsgrad"),
    ("train --optimizer torch.optim:SGD --optimizer-arg momentum=0.9 --optimizer-arg nesterov=1",
     "takes true or false for nesterov"),
    ("train --optimizer adamw --optimizer-arg eps=small", "takes a number for eps"),
]


@pytest.mark.parametrize("command,words", IGNORED, ids=[c for c, _ in IGNORED])
def test_an_option_the_other_choices_would_ignore_is_refused(command, words, tmp_path, monkeypatch, capsys):
    from hvdkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "space.yaml").write_text("fixed: {model: mlp, epochs: 4, num_samples: 64}\n"
                                         "grid: {lr: [0.01, 0.02]}\n")
    with pytest.raises(SystemExit) as exit_:
        main(command.split())
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and words in lines[0], (command, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["space.yaml"], "a refused command wrote something"


def test_an_option_in_its_own_setting_is_still_taken(tmp_path, monkeypatch, capsys):
    """The other half of the rows above: where each option does something, it is accepted."""
    from hvdkit.cli import main

    monkeypatch.chdir(tmp_path)
    for command in ("run --dry-run -np 2 --launcher horovodrun --controller gloo -- --epochs 1",
                    "run --write-discovery-script d.sh --slots 4",
                    "slurm --backend ddp --gpus-per-node 2 --tasks-per-node 2 --process-group nccl -- --epochs 1"):
        with pytest.raises(SystemExit) as exit_:
            main(command.split())
        assert exit_.value.code == 0, (command, capsys.readouterr())
    # training ends its process itself (os._exit after the run): a real one
    proc = subprocess.run([*HVDKIT, "train", "--optimizer", "adamw", "--optimizer-arg", "amsgrad=true",
                           "--optimizer-arg", "eps=1e-6", "--epochs", "1", "--num-samples", "64", "--model", "tiny"],
                          env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_powersgd_that_would_never_compress_says_why():
    """#44 item 6: a start beyond the run, or a rank that leaves no matrix to compress, is one
    warning each at set-up (hvdkit.loop), not a silent run of plain averaging."""
    import torch

    from hvdkit.backends.powersgd import idle_reasons
    from hvdkit.config import parse_compression

    shapes = [torch.Size([64, 32]), torch.Size([64])]
    assert idle_reasons(parse_compression("powersgd"), shapes, steps=100, at_step=0) == []
    late = idle_reasons(parse_compression("powersgd"), shapes, steps=4, at_step=0)  # the default start, 10
    assert len(late) == 1 and "starts at step 10 and this run has 4 optimizer steps" in late[0]
    assert idle_reasons(parse_compression("powersgd"), shapes, steps=4, at_step=12) == []  # resumed past it
    big = idle_reasons(parse_compression("powersgd:rank=1000000000,start=2"), shapes, steps=100, at_step=0)
    assert len(big) == 1 and "no parameter matrix is larger than its two factors" in big[0]
