"""Tables (markdown) and plots (PNG) from a benchmark :class:`~hvdkit.bench.suite.Report`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MB = 1 << 20


def _size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // 1024} KB"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_tables(rep: Any) -> str:
    """Markdown tables for every experiment present in ``rep.summary``."""
    env, s = rep.env, rep.summary
    out = [f"Machine: {env['cpu']}, {env['cores']} cores, torch {env['torch']}, horovod {env['horovod']}, "
           f"GPUs: {', '.join(env['gpus']) or 'none'}; {env['date']}"]
    hosts = s.get("reducer_hosts") or s.get("allreduce", {}).get("hosts") or []
    if len(hosts) > 1:
        out.append(f"Cross-node: ranks on {', '.join(hosts)}. If these are scripts/local-cluster.sh nodes, "
                   "the 'network' is veth pairs between namespaces on ONE host (kernel memory copies, "
                   "no NIC): read it as the cost of TCP and of leaving shared memory, not of a fabric.")
    if "paths" in s:
        p = s["paths"]
        out += ["", "### The launch paths users run, through the training loop (2 ranks; rotated rounds)",
                f"step ms: median [IQR] over {p['rounds']} rounds x {p['epochs'] - 1} measured epochs of "
                f"{p['steps']} steps; (x DDP) with a bootstrap 95% CI over rounds; floor = the same training, "
                f"no communication, processes sharing the cores. 'horovod default' is `hvdkit run --backend "
                f"horovod` (controller chosen: {p['default_controller']})."]
        headers = ["model", "floor ms", *p["paths"]]
        rows = []
        for r in p["rows"]:
            cells = [r["model"], f"{r['floor_s'] * 1e3:.1f}"]
            for path in p["paths"]:
                x = r["paths"][path]
                point, lo, hi = x["over_ddp"]
                cells.append(f"{x['median_s'] * 1e3:.1f} [{x['p25_s'] * 1e3:.1f}-{x['p75_s'] * 1e3:.1f}] "
                             f"({point:.2f}x DDP [{lo:.2f}, {hi:.2f}]; {x['over_floor']:.2f}x floor)")
            rows.append(cells)
        out.append(_table(headers, rows))
        out += [f"* {note}" for note in p["notes"]]
    if "reducer" in s:
        def ms(r: dict, v: str) -> str:
            x = r[v]
            return (f"{x['median_s'] * 1e3:.1f} [{x['p25_s'] * 1e3:.1f}-{x['p75_s'] * 1e3:.1f}] "
                    f"cpu {x['cpu_s_per_step'] * 1e3:.0f} ({x['over_floor']:.2f}x floor)")

        def ratio(x: dict) -> str:
            return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"

        out += ["", "### Gradient reducers: Horovod bucketed vs Horovod stock vs DDP (A/B/C blocks alternated)",
                "step ms: median [IQR], CPU ms per step and rank; floor = 1-process compute + mpi4py "
                "Allreduce of the gradient bytes, same run; ratios of median step time with bootstrap 95% CI",
                _table(["model", "floor ms", "Horovod bucketed", "Horovod bucketed, 5 ms cycle",
                        "Horovod stock", "DDP", "bucketed / DDP", "bucketed 5 ms / DDP", "stock / bucketed"],
                       [[r["model"], f"{r['floor_s'] * 1e3:.1f} ({r['compute_s'] * 1e3:.1f} + "
                         f"{r['mpi_allreduce_s'] * 1e3:.2f})", ms(r, "bucketed"), ms(r, "bucketed-cycle5"),
                         ms(r, "stock"), ms(r, "ddp"), ratio(r["bucketed_over_ddp"]),
                         ratio(r["cycle5_over_ddp"]), ratio(r["stock_over_bucketed"])]
                        for r in s["reducer"]])]
    if "ab" in s:
        out += ["", "### Horovod vs DDP, equal settings (fusion = bucket = 25 MB), A/B alternating",
                _table(["model", "Horovod samples/s (median ± 95%)", "DDP samples/s", "Horovod / DDP",
                        "comm share Horovod", "comm share DDP"],
                       [[r["model"], f"{r['horovod_samples_s']['median']:.0f} ± {r['horovod_samples_s']['ci95']:.0f}",
                         f"{r['ddp_samples_s']['median']:.0f} ± {r['ddp_samples_s']['ci95']:.0f}",
                         f"{r['horovod_over_ddp']:.2f}", f"{r['horovod_comm_share']:.0%}",
                         f"{r['ddp_comm_share']:.0%}"] for r in s["ab"]])]
    if "fusion" in s:
        f = s["fusion"]
        out += ["", f"### Tensor fusion sweep (mlp, {len(f['rows'])} settings; compute-only step "
                f"{f['compute_step_s'] * 1e3:.1f} ms)",
                _table(["setting", "step ms", "communication ms"],
                       [[r["setting"], f"{r['step_s'] * 1e3:.2f}", f"{r['comm_s'] * 1e3:.2f}"] for r in f["rows"]])]
        if "unfused_over_fused_comm" in f:
            out.append(f"\nUnfused / fused (128 MB) communication time: {f['unfused_over_fused_comm']:.2f}x")
    if "scaling" in s:
        sc = s["scaling"]
        out += ["", f"### Scaling ({sc['cores']} cores; * = more ranks than cores, oversubscribed)",
                _table(["model", "np", "backend", "samples/s", "efficiency", "comm share"],
                       [[r["model"], f"{r['np']}{'*' if r['oversubscribed'] else ''}", r["backend"],
                         f"{r['samples_s']:.0f}", "-" if r["efficiency"] is None else f"{r['efficiency']:.0%}",
                         f"{r['comm_share']:.0%}"] for r in sc["rows"]])]
    if "allreduce" in s:
        a = s["allreduce"]
        out += ["", f"### Allreduce bandwidth (world {a['world_size']}; GB/s; busbw = algbw x 2(n-1)/n)",
                _table(["size", "Horovod algbw", "Horovod busbw", "torch gloo algbw", "torch gloo busbw",
                        "mpi4py busbw (floor)", "memcpy"],
                       [[_size(r["bytes"]), f"{r['horovod_algbw'] / 1e9:.3f}", f"{r['horovod_busbw'] / 1e9:.3f}",
                         f"{r['torch_algbw'] / 1e9:.3f}", f"{r['torch_busbw'] / 1e9:.3f}",
                         f"{r['mpi_busbw'] / 1e9:.3f}",
                         f"{r['memcpy_algbw'] / 1e9:.2f}"] for r in a["rows"]])]
    if "ckpt" in s:
        c = s["ckpt"]
        out += ["", f"### Checkpoint I/O ({c['params'] / 1e6:.0f}M params, {c['state_mb']:.0f} MB, fsync'd)",
                _table(["", "HDF5 (hvdkit)", "torch.save/load", "ratio"],
                       [["save s", f"{c['hdf5_save_s']:.3f}", f"{c['torch_save_s']:.3f}",
                         f"{c['save_ratio_hdf5_over_torch']:.2f}x"],
                        ["load s (incl. CRC check)", f"{c['hdf5_load_s']:.3f}", f"{c['torch_load_s']:.3f}",
                         f"{c['load_ratio_hdf5_over_torch']:.2f}x"]])]
    if "overhead" in s:
        o = s["overhead"]
        out += ["", "### hvdkit loop vs plain horovod.torch (mlp, alternating runs)",
                _table(["", "samples/s median", "± 95%"],
                       [["raw Horovod", f"{o['raw_samples_s']['median']:.0f}", f"{o['raw_samples_s']['ci95']:.0f}"],
                        ["hvdkit train", f"{o['hvdkit_samples_s']['median']:.0f}",
                         f"{o['hvdkit_samples_s']['ci95']:.0f}"]]),
                f"\nhvdkit overhead: {o['overhead']:+.1%} of throughput"]
    if "model" in s:
        m = s["model"]
        out += ["", f"### Prediction (alpha-beta ring model fitted to torch gloo: alpha = {m['alpha_s'] * 1e6:.1f} us, "
                f"B = {m['bandwidth_Bps'] / 1e9:.2f} GB/s; a single Horovod allreduce fits alpha = "
                f"{m['horovod_alpha_s'] * 1e6:.0f} us, its cycle wait included). A prediction, not a measurement."]
        for model, info in m["models"].items():
            for scenario, rows in info["scenarios"].items():
                out += ["", f"{model} ({info['tensors']} tensors, {info['grad_bytes'] / MB:.1f} MB of gradients, "
                        f"compute {info['compute_step_s'] * 1e3:.1f} ms/step), {scenario}:",
                        _table(["workers", "step ms fused", "efficiency fused", "efficiency unfused",
                                "overlap bound"],
                               [[r["workers"], f"{r['step_fused_s'] * 1e3:.1f}", f"{r['efficiency_fused']:.0%}",
                                 f"{r['efficiency_unfused']:.0%}", f"{r['efficiency_overlap_bound']:.0%}"]
                                for r in rows])]
    if rep.targets:
        out += ["", "### Targets (figures to report against, not tests)",
                _table(["target", "measured", "met"],
                       [[t["target"], t["value"], "yes" if t["met"] else "NO"] for t in rep.targets])]
    return "\n".join(out) + "\n"


def render_plots(rep: Any, out: Path) -> list[Path]:
    """One PNG per experiment present; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, written = rep.summary, []

    def save(fig: Any, name: str) -> None:
        path = out / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    if "paths" in s:
        p = s["paths"]
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(p["rows"]) * len(p["paths"]) / 3), 4))
        width = 0.8 / len(p["paths"])
        for k, path in enumerate(p["paths"]):
            xs = [i + (k - (len(p["paths"]) - 1) / 2) * width for i in range(len(p["rows"]))]
            points = [r["paths"][path]["over_ddp"] for r in p["rows"]]
            ax.bar(xs, [x[0] for x in points], width, label=path,
                   yerr=[[x[0] - x[1] for x in points], [x[2] - x[0] for x in points]], capsize=2)
        for i, r in enumerate(p["rows"]):  # the floor, as a share of DDP's step time
            ddp = r["paths"]["mpirun ddp"]["median_s"]
            ax.plot([i - 0.45, i + 0.45], [r["floor_s"] / ddp] * 2, "k--", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(p["rows"])), [r["model"] for r in p["rows"]])
        ax.set_ylabel("step time / DDP's (lower is faster)")
        ax.set_title("launch paths, 2 ranks (dashed: no-communication floor; bars: 95% CI over rounds)",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        save(fig, "paths")

    if "ab" in s:
        fig, ax = plt.subplots(figsize=(6, 4))
        models = [r["model"] for r in s["ab"]]
        xs = list(range(len(models)))
        for off, key, label in ((-0.2, "horovod_samples_s", "Horovod"), (0.2, "ddp_samples_s", "DDP")):
            ax.bar([x + off for x in xs], [r[key]["median"] for r in s["ab"]], 0.4,
                   yerr=[r[key]["ci95"] for r in s["ab"]], label=label, capsize=4)
        ax.set_xticks(list(xs), models)
        ax.set_ylabel("samples/s (median, 95% CI)")
        ax.set_title("Horovod vs DDP, equal settings, A/B alternating")
        ax.legend()
        save(fig, "ab")
    if "fusion" in s:
        rows = [r for r in s["fusion"]["rows"] if r["kind"] == "horovod" and not r.get("cycle_ms")]
        ddp = [r for r in s["fusion"]["rows"] if r["kind"] == "ddp"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([max(r["fusion_mb"], 0.25) for r in rows], [r["comm_s"] * 1e3 for r in rows], "o-",
                label="Horovod: fusion threshold")
        ax.plot([r["bucket_mb"] for r in ddp], [r["comm_s"] * 1e3 for r in ddp], "s--", label="DDP: bucket_cap_mb")
        ax.set_xscale("log")
        ax.set_xlabel("MB (0 = fusion off, drawn at 0.25)")
        ax.set_ylabel("communication ms per step (step - compute)")
        ax.set_title("mlp (many small tensors)")
        ax.legend()
        save(fig, "fusion")
    if "scaling" in s:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
        for model in sorted({r["model"] for r in s["scaling"]["rows"]}):
            for backend in ("horovod", "ddp"):
                rows = [r for r in s["scaling"]["rows"] if r["model"] == model and r["backend"] == backend]
                a1.plot([r["np"] for r in rows], [r["samples_s"] for r in rows], "o-", label=f"{model} {backend}")
                a2.plot([r["np"] for r in rows], [r["efficiency"] or 0 for r in rows], "o-", label=f"{model} {backend}")
        a1.set_xlabel("ranks (np > cores is oversubscribed)")
        a1.set_ylabel("samples/s")
        a2.set_xlabel("ranks")
        a2.set_ylabel("efficiency = thr(N) / (N thr(1))")
        a1.legend(fontsize=7)
        save(fig, "scaling")
    if "allreduce" in s:
        rows = s["allreduce"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["bytes"] for r in rows], [r["horovod_busbw"] / 1e9 for r in rows], "o-", label="Horovod busbw")
        ax.plot([r["bytes"] for r in rows], [r["torch_busbw"] / 1e9 for r in rows], "s-", label="torch gloo busbw")
        ax.plot([r["bytes"] for r in rows], [r["memcpy_algbw"] / 1e9 for r in rows], "k:", label="memcpy (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel("GB/s")
        ax.set_title(f"allreduce, world {s['allreduce']['world_size']}")
        ax.legend()
        save(fig, "allreduce")
    if "model" in s:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model, info in s["model"]["models"].items():
            for i, (scenario, rows) in enumerate(info["scenarios"].items()):
                ax.plot([r["workers"] for r in rows], [r["efficiency_fused"] for r in rows],
                        "o-" if i == 0 else "s--", label=f"{model}: {scenario.split(':')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel("predicted scaling efficiency (fused)")
        ax.set_title("Prediction, not measurement")
        ax.legend(fontsize=7)
        save(fig, "model")
    return written
