"""hvdkit.advice: the knob the network bench measured, said once when communication shows, and
nothing where nothing was measured or nothing clearly helped."""

from __future__ import annotations

import json
import os
import subprocess

from helpers import HVDKIT, base_env
from hvdkit.advice import MEASURED, advise, bench_file, measured_controller
from hvdkit.config import BackendConfig, DDPOptions, HorovodOptions, TrainConfig
from hvdkit.launch.local import horovod_controller


def _variant(median: float, spread: float = 0.01) -> dict:
    return {"median_s": median, "p25_s": median - spread, "p75_s": median + spread}


def _bench(tmp_path, variants: dict, options: dict):
    path = tmp_path / "network.json"
    path.write_text(json.dumps({"rows": [{"link": "1gbit", "model": "resnet18", "variants": variants}],
                                "options": options}))
    return path


OPTIONS = {"horovod default": [], "horovod powersgd": ["--compression", "powersgd"],
           "horovod bucket=5MB": ["--bucket-cap-mb", "5"], "ddp default": [], "ddp fp16": ["--compression", "fp16"]}


def test_the_clearly_fastest_knob_of_the_runs_own_backend_is_named_with_its_measured_ratio(tmp_path):
    path = _bench(tmp_path, {"horovod default": _variant(0.50), "horovod powersgd": _variant(0.30),
                             "horovod bucket=5MB": _variant(0.45), "ddp default": _variant(0.52),
                             "ddp fp16": _variant(0.20)}, OPTIONS)
    tip = advise(TrainConfig(backend=BackendConfig(name="horovod")), 0.41, path)
    assert tip is not None and "communication wait is 41%" in tip and "(1gbit)" in tip
    assert "--compression powersgd at 0.60x the step time of horovod default on resnet18" in tip
    # already on it: the next clear winner of its backend (DDP's fp16 is not Horovod's knob)
    on_it = TrainConfig(backend=BackendConfig(name="horovod", horovod=HorovodOptions(compression="powersgd:rank=4")))
    assert "--bucket-cap-mb 5 at 0.90x" in advise(on_it, 0.41, path)
    ddp = TrainConfig(backend=BackendConfig(name="ddp", ddp=DDPOptions(compression="fp16")))
    assert advise(ddp, 0.41, path) is None  # the only DDP knob that helped is in use


def test_no_file_or_no_clear_winner_says_nothing(tmp_path, monkeypatch):
    cfg = TrainConfig(backend=BackendConfig(name="horovod"))
    assert advise(cfg, 0.9, tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert advise(cfg, 0.9, tmp_path / "bad.json") is None
    within_noise = _bench(tmp_path, {"horovod default": _variant(0.50, 0.05), "horovod powersgd": _variant(0.47, 0.05)},
                          OPTIONS)
    assert advise(cfg, 0.9, within_noise) is None
    monkeypatch.setenv("HVDKIT_NETWORK_BENCH", str(within_noise))
    assert bench_file() == within_noise
    monkeypatch.setenv("HVDKIT_NETWORK_BENCH", "")  # off (the suite's runs: tests/helpers.py)
    assert bench_file() is None and advise(cfg, 0.9) is None
    monkeypatch.delenv("HVDKIT_NETWORK_BENCH")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert bench_file() == tmp_path / "cache" / "hvdkit" / "network.json"


def _rows(tmp_path, *rows: tuple[str, float, float]):
    """A bench file with one row per (model, horovod default, horovod gloo) median."""
    path = tmp_path / "controllers.json"
    path.write_text(json.dumps({"options": {}, "rows": [
        {"link": "1gbit", "model": m, "variants": {"horovod default": _variant(d), "horovod gloo": _variant(g)}}
        for m, d, g in rows]}))
    return path


def test_the_gloo_controller_is_chosen_only_where_measured_clearly_faster_on_every_model(tmp_path):
    both = _rows(tmp_path, ("resnet18", 0.50, 0.44), ("gpt", 0.40, 0.36))
    controller, why = measured_controller(both)
    assert controller == "gloo" and why.startswith(MEASURED) and "0.88-0.90x" in why and "link (1gbit)" in why
    assert measured_controller(_rows(tmp_path, ("resnet18", 0.56, 0.49), ("gpt", 0.31, 0.37))) is None
    assert measured_controller(_rows(tmp_path, ("resnet18", 0.50, 0.49))) is None  # within the noise
    assert measured_controller(tmp_path / "missing.json") is None


def test_auto_takes_the_measured_controller_only_across_hosts(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDKIT_NETWORK_BENCH", str(_rows(tmp_path, ("resnet18", 0.56, 0.49))))
    across, why = horovod_controller("auto", hosts="node1:1,node2:1")
    assert across == "gloo" and why.startswith(MEASURED)
    # one node never crosses the measured link; asked-for and elastic choices are not overridden
    assert horovod_controller("auto", hosts="node1:2")[0] == "mpi"
    assert horovod_controller("auto")[0] == "mpi"
    assert horovod_controller("mpi", hosts="node1:1,node2:1") == ("mpi", "asked for")
    monkeypatch.setenv("HVDKIT_NETWORK_BENCH", "")
    assert horovod_controller("auto", hosts="node1:1,node2:1")[0] == "mpi"


def _bad_bench_files(tmp_path):
    """Every kind of file a user may name that advice cannot use: (what, path)."""
    good_row = {"link": "1gbit", "model": "resnet18",
                "variants": {"horovod default": _variant(0.5), "horovod gloo": _variant(0.3)}}

    def report(**changes):
        return json.dumps({"options": {}, "rows": [{**good_row, **changes}]})

    texts = {
        "empty": "", "not json": "{not json", "a list": "[]", "not utf-8": b"\xff\xfe\x00",
        "rows a string": json.dumps({"rows": "abc", "options": {}}),
        "no options": json.dumps({"rows": []}),
        "options not strings": json.dumps({"rows": [], "options": {"x": [1]}}),
        "a missing key": report(variants={"horovod default": {"median_s": 0.5, "p25_s": 0.4}}),
        "a zero median": report(variants={"horovod default": _variant(0.0, 0.0), "horovod gloo": _variant(0.3)}),
        "figures as strings": report(variants={"horovod default": {"median_s": "0.5", "p25_s": "0.4", "p75_s": "0.6"},
                                               "horovod gloo": _variant(0.3)}),
        "NaN medians": report(variants={"horovod default": _variant(float("nan")),
                                        "horovod gloo": _variant(float("nan"))}),
        "a name of 1 MB": report(link="x" * 1_000_000),
        "a variant not a mapping": report(variants={"horovod default": [0.5]}),
    }
    out = []
    for k, (what, text) in enumerate(texts.items()):
        path = tmp_path / f"bad{k}.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        out.append((what, path))
    (tmp_path / "a-directory").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    return out + [("missing", tmp_path / "missing.json"), ("a directory", tmp_path / "a-directory"),
                  ("a FIFO", tmp_path / "a-fifo")]


def test_a_bench_file_that_cannot_be_used_is_one_warning_and_never_advice(tmp_path, caplog):
    """Advice never fails a run or a dry run: each file of the wrong shape (the class of #44's
    item 4) gives no advice, no controller switch, and one warning line naming the file."""
    cfg = TrainConfig(backend=BackendConfig(name="horovod"))
    for what, path in _bad_bench_files(tmp_path):
        caplog.clear()
        assert advise(cfg, 0.9, path) is None, what
        assert measured_controller(path) is None, what  # same file, warned once
        warnings = [r.getMessage() for r in caplog.records if r.name == "hvdkit"]
        assert len(warnings) == 1, (what, warnings)
        line = warnings[0]
        assert line.startswith(f"WARNING: ignoring the network bench file {path}: ") and "\n" not in line, what
        assert len(line) < 400 and "HINT:" in line, (what, line)

def test_the_default_bench_file_never_written_says_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HVDKIT_NETWORK_BENCH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert measured_controller() is None
    assert advise(TrainConfig(backend=BackendConfig(name="horovod")), 0.9) is None
    assert not [r for r in caplog.records if r.name == "hvdkit"]


def test_a_dry_run_across_hosts_with_a_bad_bench_file_warns_and_prints_its_command(tmp_path):
    """The end-to-end form: a bench file the user named that is NaN-filled, across two hosts."""
    path = tmp_path / "nan.json"
    path.write_text(json.dumps({"options": {}, "rows": [{"link": "1gbit", "model": "gpt", "variants": {
        "horovod default": _variant(float("nan")), "horovod gloo": _variant(float("nan"))}}]}))
    proc = subprocess.run([*HVDKIT, "run", "--dry-run", "-np", "2", "-H", "node1:1,node2:1", "--backend", "horovod",
                           "--", "--model", "tiny"], env=base_env(HVDKIT_NETWORK_BENCH=str(path)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    warned = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln]
    assert len(warned) == 1 and str(path) in warned[0] and "not a positive number" in warned[0], proc.stderr
    assert "horovodrun" in proc.stdout and "nan" not in proc.stdout.lower(), proc.stdout


def test_a_reason_names_at_most_three_links_whatever_the_file_holds(tmp_path):
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"options": {}, "rows": [
        {"link": f"link{i}", "model": "gpt", "variants": {"horovod default": _variant(0.5),
                                                          "horovod gloo": _variant(0.4)}} for i in range(20_000)]}))
    controller, why = measured_controller(path)
    assert controller == "gloo" and "and 19997 more" in why and len(why) < 400, why
