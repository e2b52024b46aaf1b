"""``hvdkit ckpt show|verify`` and ``hvdkit data make-synthetic|check``: checkpoints and datasets."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from ..config import MODEL_NAMES
from .common import translate_errors, usable_output

if TYPE_CHECKING:
    from pathlib import Path


@click.group("ckpt")
def ckpt_group() -> None:
    """Inspect hvdkit HDF5 checkpoints."""


@ckpt_group.command("show")
@click.argument("path", type=click.Path(dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@translate_errors
def ckpt_show(path: str, as_json: bool) -> None:
    """Epoch, step, tensors, sizes, versions and checksum verdict of PATH.

    PATH may be a checkpoint directory (its 'latest' file is shown). A file that does
    not verify is one line naming the damage, and exit 1.
    """
    from ..checkpoint import summarize_checkpoint

    target = _resolve(path)
    info = summarize_checkpoint(target)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
    else:
        meta = info["meta"]
        total = sum(t[3] for t in info["tensors"])
        click.echo(f"checkpoint   {target}")
        for key in ("step", "epoch", "samples_seen", "world_size", "backend",
                    "hvdkit_version", "torch_version", "created"):
            if meta.get(key) is not None:
                click.echo(f"{key:<12} {meta.get(key)}")
        click.echo(f"{'states':<12} {', '.join(f'{k} ({v})' for k, v in meta.get('states', {}).items())}")
        metrics = meta.get("metrics") or {}
        if metrics:
            click.echo(f"{'metrics':<12} " + ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in metrics.items()))
        click.echo(f"tensors      {len(info['tensors'])} ({total / 2**20:.2f} MiB)")
        for name, dtype, shape, nbytes in info["tensors"]:
            click.echo(f"  {name:<40} {dtype:<9} {str(list(shape)):<16} {nbytes:>12,d} B")
        click.echo("checksum     OK")  # a file that does not verify is one line and exit 1, above


def _resolve(path: str) -> Path:
    """PATH itself, or the checkpoint a directory's ``latest`` names (one-line errors)."""
    from pathlib import Path

    target = Path(path)
    if not target.is_dir():
        return target
    try:
        name = (target / "latest").read_text().strip()
    except FileNotFoundError:
        raise click.ClickException(
            f"{target} has no 'latest' checkpoint pointer; pass a ckpt-*.h5 file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"{target}/latest is unreadable ({exc}); pass a ckpt-*.h5 file") from None
    if not name or "/" in name:
        raise click.ClickException(f"{target}/latest is damaged ({name[:40]!r}); pass a ckpt-*.h5 file")
    return target / name


@ckpt_group.command("verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@translate_errors
def ckpt_verify(paths: tuple[str, ...]) -> None:
    """Check every byte of each checkpoint; a directory means all its ckpt-*.h5 files.

    Prints one line per file (OK or FAILED with the reason); exits 1 if any failed.
    """
    from pathlib import Path

    from ..checkpoint import verify_checkpoint

    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("ckpt-*.h5")) if path.is_dir() else [path]
    if not files:
        raise click.ClickException(f"no ckpt-*.h5 files in {' '.join(paths)}")
    failed = 0
    for file in files:
        ok, message = verify_checkpoint(file)
        failed += not ok
        click.echo(f"OK      {file}" if ok else f"FAILED  {message}")  # message names the file
    if failed:
        click.echo(f"Error: {failed} of {len(files)} checkpoint(s) failed verification", err=True)
    sys.exit(1 if failed else 0)


@ckpt_group.command("export")
@click.argument("checkpoint", type=click.Path(dir_okay=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]), default="safetensors", show_default=True,
              help="safetensors (safetensors.torch.load_file, transformers) or a torch state dict (torch.load).")
@click.option("--state", default=None, help="The module state to export (default: the checkpoint's one module).")
@translate_errors
def ckpt_export(checkpoint: str, out: str, fmt: str, state: str | None) -> None:
    """The model weights of CHECKPOINT (a ckpt-*.h5 file, or a directory: its latest) as one file
    OUT that other tools load, whatever sharding and world size trained them; one tensor in
    memory at a time."""
    from ..checkpoint.export import export_weights
    from ..fileio import check_output_path

    target = _resolve(checkpoint)
    destination = check_output_path(out, "OUT")
    count, size = export_weights(target, destination, fmt, state)
    click.echo(f"wrote {destination}: {count} tensors, {size / 2**20:.1f} MiB ({fmt})")


@click.group("data")
def data_group() -> None:
    """Datasets: check one, make synthetic data, or import real data that ships with packages."""


@data_group.command("import-digits")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--image-size", type=click.IntRange(min=8), default=8, show_default=True,
              help="Upsample the 8x8 images (e.g. 32 for a ResNet).")
@click.option("--channels", type=click.Choice(["1", "3"]), default="1", show_default=True)
@translate_errors
def import_digits_command(directory: str, image_size: int, channels: str) -> None:
    """scikit-learn's 1,797 handwritten digits -> DIRECTORY/train.h5 and val.h5 (300 held out)."""
    from ..importers import import_digits

    usable_output(directory, "DIRECTORY", directory=True)
    info = import_digits(directory, image_size, int(channels))
    click.echo(f"wrote {info['directory']}/train.h5 ({info['train']} images) and val.h5 ({info['val']}), "
               f"shape {tuple(info['shape'])}, 10 classes")


@data_group.command("import-text")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--block", type=click.IntRange(min=2), default=64, show_default=True,
              help="Characters of context per sample (windows of block+1).")
@click.option("--max-bytes", type=click.IntRange(min=10_000), default=1_500_000, show_default=True,
              help="Characters of standard-library source to use (whole modules, sorted by name).")
@translate_errors
def import_text_command(directory: str, block: int, max_bytes: int) -> None:
    """The Python standard library's source as a character corpus -> DIRECTORY/train.h5, val.h5.

    The last 10% (whole modules) is the validation set. Prints the vocabulary size and the
    unigram baseline a language model must beat.
    """
    from ..importers import import_text

    usable_output(directory, "DIRECTORY", directory=True)
    info = import_text(directory, block, max_bytes)
    click.echo(f"wrote {info['directory']}/train.h5 ({info['train']} windows) and val.h5 ({info['val']}) from "
               f"{info['characters']:,} characters of {info['modules']} modules; vocab {info['vocab_size']}, "
               f"unigram entropy {info['unigram_entropy_nats']:.4f} nats/char (on validation "
               f"{info['unigram_val_xent_nats']:.4f})")


@data_group.command("make-synthetic")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--model", type=click.Choice(sorted(MODEL_NAMES)), default="cnn", show_default=True)
@click.option("--num-samples", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True)
@translate_errors
def make_synthetic(path: str, model: str, num_samples: int, seed: int) -> None:
    """Write the synthetic dataset of MODEL to an HDF5 file (datasets x, y)."""
    from ..data import make_synthetic_h5
    from ..fileio import check_output_path

    check_output_path(path, "make-synthetic")
    out = make_synthetic_h5(path, model, num_samples, seed)
    click.echo(f"wrote {out} ({num_samples} samples for model {model}, {out.stat().st_size / 2**20:.1f} MiB)")


@data_group.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--model", type=click.Choice(sorted(MODEL_NAMES)), default=None,
              help="Also check sample shape and label range against this model.")
@click.option("--scan-values/--no-scan-values", default=True, show_default=True,
              help="Read every sample and report the first NaN/inf.")
@translate_errors
def data_check(path: str, model: str | None, scan_values: bool) -> None:
    """Check an HDF5 dataset as 'hvdkit train --data' will (one line; exit 1 if bad)."""
    from ..data import check_h5_dataset

    n = check_h5_dataset(path, model, scan_values=scan_values)
    click.echo(f"OK {path}: {n} samples" + (f", fits model {model}" if model else ""))
