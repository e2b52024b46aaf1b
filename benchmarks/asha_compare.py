"""Time to the best configuration with and without ASHA, on one search space, in one run.

usage: python benchmarks/asha_compare.py OUT_DIR
Runs `hvdkit sweep` twice on the same 9-trial grid (local, 3 trials at a time): once with
scheduler none, once with asha. Reports wall time, when the eventual best trial's result
appeared, trial-epochs used, and the best trial; writes OUT_DIR/asha-compare.json and .md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SPACE = """metric: final_loss
mode: min
fixed: {model: mlp, epochs: 9, num_samples: 1024, batch_size: 32}
grid: {lr: [0.02, 0.0005, 0.2, 0.002, 0.001, 0.01, 0.004, 0.08, 0.04]}
scheduler: %s
"""


def run(out: Path, scheduler: str) -> dict:
    space = out / f"space-{scheduler}.yaml"
    space.write_text(SPACE % scheduler)
    sweep = out / f"sweep-{scheduler}"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "hvdkit", "sweep", str(space), "--out", str(sweep), "--backend",
                    "local", "--parallel", "3"], check=True, capture_output=True, timeout=3600)
    wall = time.time() - t0
    rows = json.loads((sweep / "results.json").read_text())
    done = [r for r in rows if r["status"] == "completed"]
    best = min(done, key=lambda r: r["final_loss"])
    return {"scheduler": scheduler, "wall_s": round(wall, 1),
            "best_found_s": round(Path(best["file"]).stat().st_mtime - t0, 1),
            "best_trial": best["trial"], "best_lr": best["params"]["lr"], "best_loss": best["final_loss"],
            "trial_epochs": sum(r["epochs"] for r in rows), "full_grid_epochs": 9 * len(rows),
            "pruned": sum(r["status"] == "pruned" for r in rows)}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = [run(out, "none"), run(out, "asha")]
    (out / "asha-compare.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| scheduler | wall (s) | best result at (s) | best trial (lr) | best loss | trial-epochs | pruned |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['scheduler']} | {r['wall_s']} | {r['best_found_s']} | {r['best_trial']} "
                     f"({r['best_lr']}) | {r['best_loss']:.6f} | {r['trial_epochs']} of "
                     f"{r['full_grid_epochs']} | {r['pruned']} |")
    (out / "asha-compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "asha-compare"))
