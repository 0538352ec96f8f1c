"""``isoaudit gate RUN --max kl_k3=1e-3 --max train_rollout_logprob_abs_diff=1e-6 [--min ...] [--steps A..B]``:
a CI regression gate on backend parity (audit.gates). ``--exact`` (alias ``--fail-closed``) fails every
step with a token whose logprob bits differ between the sides, naming the count and the max |Δ|.

Exit codes: 0 every gate holds on every checked step, 1 bad input (unknown metric, no such run, no
compared step), 2 a gate failed (the table says where).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from isoaudit.cli.common import DatabaseOption, console, open_store

MaxOption = Annotated[
    list[str] | None,
    typer.Option(
        "--max",
        help="METRIC=BOUND: the metric must stay <= BOUND (any framework's name).",
        show_default=False,
    ),
]
MinOption = Annotated[
    list[str] | None,
    typer.Option("--min", help="METRIC=BOUND: the metric must stay >= BOUND.", show_default=False),
]


app = typer.Typer()


@app.command("gate")
def gate(
    run_id: Annotated[str, typer.Argument(metavar="RUN", help="Run id (see `isoaudit runs list`).")],
    maxima: MaxOption = None,
    minima: MinOption = None,
    steps: Annotated[
        str | None, typer.Option("--steps", help="Only these steps: N, N,M,... or A..B.")
    ] = None,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            "--fail-closed",
            help="Fail any step with a non-identical token (float32 logprob bits differ; "
            "torch.equal-strict), naming the count and max |Δ|.",
        ),
    ] = False,
    database: DatabaseOption = None,
) -> None:
    """Fail (exit 2) when any compared step of RUN breaks a bound; a table names each failure."""
    from isoaudit.audit.gates import GateError, bounds_of, check, parse_assignment, parse_steps

    try:
        bounds = bounds_of(
            dict(parse_assignment(text, "--max") for text in maxima or []),
            dict(parse_assignment(text, "--min") for text in minima or []),
            exact=exact,
        )
        chosen = parse_steps(steps) if steps is not None else None
        with console.status("comparing queued samples…", spinner="dots"):
            result = check(open_store(database), run_id, bounds, chosen)
    except GateError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None

    if result.passed:
        console.print(
            f"[green]pass[/green]: {len(bounds)} gate(s) hold on {len(result.steps)} step(s) of run {run_id}"
        )
        raise typer.Exit(0)
    table = Table("step", "metric", "key", "bound", "value", "why", title=f"run {run_id}: gates that failed")
    for failure in result.failures:
        table.add_row(
            str(failure.step),
            failure.bound.name,
            failure.bound.key if failure.bound.key != failure.bound.name else "",
            failure.bound.describe(),
            "—" if failure.value is None else f"{failure.value:.6g}",
            failure.reason,
        )
    console.print(table)
    failed_steps = len({f.step for f in result.failures})
    console.print(
        f"[red]fail[/red]: {len(result.failures)} failure(s) on {failed_steps} of {len(result.steps)} step(s)"
    )
    differing = [e for e in result.not_identical() if e.differing_tokens]
    if differing:
        worst = max((e.max_abs_delta for e in differing if e.max_abs_delta is not None), default=None)
        console.print(
            f"not identical: {sum(e.differing_tokens or 0 for e in differing)} differing token(s) on "
            f"{len(differing)} step(s), first at step {differing[0].step}"
            + ("" if worst is None else f", max |Δ| {worst:.6g}")
        )
    raise typer.Exit(2)
