"""`rv cost`: what a job would cost in SUs, per GPU type, from the profile's catalog. No network."""

from __future__ import annotations

from typing import Any

import click

from rv.cli.common import load_profile, print_json


@click.command()
@click.option("-g", "--gpu", "gpus", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("-t", "--type", "gpu_type", help="One GPU type (default: every type).")
@click.option("--time", "time_", default=None, help="Wall time, e.g. 30m, 2h, 1d12h (default 2:59:00).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def cost(ctx: click.Context, gpus: int, gpu_type: str | None, time_: str | None, as_json: bool) -> None:
    """Estimate the SU cost of GPUS GPUs of each type for TIME."""
    from rv.errors import UsageError
    from rv.timespec import DEFAULT_TIME, parse_duration

    _, profile = load_profile(ctx)
    catalog = profile.gpu_catalog()
    seconds = parse_duration(time_ or DEFAULT_TIME)
    if gpu_type is not None and gpu_type not in catalog:
        raise UsageError(f"unknown GPU type {gpu_type!r}; valid types: {', '.join(catalog)}")
    rows: list[dict[str, Any]] = []
    for name, g in catalog.items():
        if gpu_type is not None and name != gpu_type:
            continue
        per_hour = g.su_per_gpu_hour
        total: float | None = None if per_hour is None else round(per_hour * gpus * seconds / 3600, 2)
        rows.append(
            {
                "type": name,
                "gpus": gpus,
                "hours": round(seconds / 3600, 3),
                "su_per_gpu_hour": per_hour,
                "su": total,
            }
        )
    rows.sort(key=lambda r: (r["su"] is None, r["su"] or 0))
    if as_json:
        print_json(rows)
        return
    click.echo(f"{'TYPE':<10} {'SU/GPU-h':>9} {'SU':>11}   ({gpus} GPU x {seconds / 3600:.2f} h)")
    for r in rows:
        rate = "?" if r["su_per_gpu_hour"] is None else f"{r['su_per_gpu_hour']:.2f}"
        shown = "unknown" if r["su"] is None else ("free" if r["su"] == 0 else f"{r['su']:,.0f}")
        click.echo(f"{r['type']:<10} {rate:>9} {shown:>11}")
