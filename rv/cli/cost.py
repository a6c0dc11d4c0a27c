"""`rv cost`: what a job would cost in SUs, per GPU type, from the profile's catalog. No network."""

from __future__ import annotations

from typing import Any

import click

from rv.cli.common import load_profile, note, print_json

# Why a type shows no price: its catalog entry has no SU rate. Rivanna's built-in types carry theirs;
# a discovered cluster's come from sinfo, which knows nothing of SUs.
NO_RATE = "no SU rate in the profile's catalog (set su_per_gpu_hour under [profiles.{profile}.gpus.{type}])"


def estimate(
    catalog: dict[str, Any], gpus: int, time_: str | None, gpu_type: str | None, profile: str
) -> list[dict[str, Any]]:
    """One row per type (or the one named): its price, or why there is none. A request the type or
    the cluster cannot give (over a per-job or per-user limit, a time limit, more nodes than there
    are) is judged as ``rv run`` judges it, and gets ``possible: false`` with the limit."""
    from rv.errors import UsageError
    from rv.request import build_request
    from rv.timespec import DEFAULT_TIME, parse_duration

    seconds = parse_duration(time_ or DEFAULT_TIME)
    rows: list[dict[str, Any]] = []
    for name, g in catalog.items():
        if gpu_type is not None and name != gpu_type:
            continue
        row: dict[str, Any] = {
            "type": name, "gpus": gpus, "hours": round(seconds / 3600, 3),
            "su_per_gpu_hour": g.su_per_gpu_hour, "su": None, "possible": True, "why": None, "hint": None,
        }  # fmt: skip
        try:
            # A launcher: the resources are judged, not how one program would use several GPUs.
            build_request(catalog, command=["torchrun", "train.py"], gpus=gpus, gpu_type=name, time=time_)
        except UsageError as exc:
            row.update(possible=False, why=exc.message, hint=exc.hint)
        else:
            if g.su_per_gpu_hour is None:
                row["why"] = NO_RATE.format(profile=profile, type=name)
            else:
                row["su"] = round(g.su_per_gpu_hour * gpus * seconds / 3600, 2)
        rows.append(row)
    rows.sort(key=lambda r: (not r["possible"], r["su"] is None, r["su"] or 0))
    return rows


@click.command()
@click.option("-g", "--gpu", "gpus", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("-t", "--type", "gpu_type", help="One GPU type (default: every type).")
@click.option("--time", "time_", default=None, help="Wall time, e.g. 30m, 2h, 1d12h (default 2:59:00).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the rows as JSON: su (null without a price), possible, and why (the limit, or no rate).",
)
@click.pass_context
def cost(ctx: click.Context, gpus: int, gpu_type: str | None, time_: str | None, as_json: bool) -> None:
    """Estimate the SU cost of GPUS GPUs of each type for TIME.

    A request the type or the cluster cannot give (a per-job limit, a time limit) is refused with the
    limit when -t names the type (exit 2), and marked in the table otherwise.
    """
    from rv.errors import UsageError

    _, profile = load_profile(ctx)
    catalog = profile.gpu_catalog()
    if gpu_type is not None and gpu_type not in catalog:
        raise UsageError(f"unknown GPU type {gpu_type!r}; valid types: {', '.join(catalog)}")
    rows = estimate(catalog, gpus, time_, gpu_type, profile.name)
    possible = [r for r in rows if r["possible"]]
    if not possible:
        if len(rows) == 1:
            raise UsageError(rows[0]["why"], hint=rows[0]["hint"])
        raise UsageError(
            f"no GPU type of profile {profile.name} can give -g {gpus} for {time_ or 'the default time'}: "
            + "; ".join(r["why"] for r in rows),
            hint="ask for fewer GPUs or less time",
        )
    if as_json:
        print_json(rows)
        return
    click.echo(f"{'TYPE':<10} {'SU/GPU-h':>9} {'SU':>11}   ({gpus} GPU × {rows[0]['hours']:.2f} h)")
    for r in rows:
        rate = "?" if r["su_per_gpu_hour"] is None else f"{r['su_per_gpu_hour']:.2f}"
        if not r["possible"]:
            click.echo(f"{r['type']:<10} {rate:>9} {'-':>11}   not possible: {r['why']}")
            continue
        shown = "unknown" if r["su"] is None else ("free" if r["su"] == 0 else f"{r['su']:,.0f}")
        click.echo(f"{r['type']:<10} {rate:>9} {shown:>11}")
    unpriced = [r["type"] for r in possible if r["su"] is None]
    if unpriced:
        # "?" and "unknown" say nothing by themselves: say why, and how to give the price.
        note(f"{', '.join(unpriced)}: " + NO_RATE.format(profile=profile.name, type=unpriced[0]))
