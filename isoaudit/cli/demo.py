"""``isoaudit demo``: a tiny GRPO job audited end to end, then the dashboard over what it wrote.

The CLI is the application's composition root: this command runs the collectors' recipe
(:mod:`collectors.rl.demo`) and serves :mod:`dashboard`, the two places in ``audit`` that reach up
the layers (declared as such in the import contract).
"""

from __future__ import annotations

from typing import Annotated

import typer

from isoaudit.cli.common import DatabaseOption, console

app = typer.Typer()


@app.command("demo")
def demo(
    database: DatabaseOption = None,
    steps: Annotated[int, typer.Option(min=1, help="GRPO steps to run.")] = 20,
    remediate_at: Annotated[
        int | None,
        typer.Option(
            help="Switch the run to the invariant kernels at this step, as the dashboard's toggle does."
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Rollout engine: auto (vLLM when it is installed, else the reference engine), vllm "
            "(remediated except its attention, which the manifest names) or reference (isoaudit's "
            "own engine; remediates fully)."
        ),
    ] = "auto",
    prompts: Annotated[int, typer.Option(min=1, help="Prompts per step.")] = 8,
    group: Annotated[int, typer.Option(min=2, help="Completions per prompt (GRPO's group).")] = 4,
    max_new: Annotated[int, typer.Option(min=1, help="Tokens per completion.")] = 6,
    model_dir: Annotated[str, typer.Option(help="Where the tiny model is made (once) and loaded from.")] = (
        ".isoaudit/demo-model"
    ),
    serve: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve the dashboard afterwards.")] = True,
    host: Annotated[str, typer.Option(help="Dashboard interface.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Dashboard port.")] = 8050,
) -> None:
    """Run a tiny GRPO job with isoaudit attached: KL alert, remediation, exact-zero mismatch."""
    if engine not in ("auto", "vllm", "reference"):
        raise typer.BadParameter("expected auto, vllm or reference", param_hint="--engine")
    if remediate_at is None:
        remediate_at = steps // 2
    if not 0 <= remediate_at < steps:
        raise typer.BadParameter(f"must be a step in 0..{steps - 1}", param_hint="--remediate-at")
    from isoaudit.collectors.rl.demo import run_demo
    from isoaudit.collectors.rl.job import JobConfig

    result = run_demo(
        steps=steps,
        remediate_at=remediate_at,
        engine=engine,  # type: ignore[arg-type]  # the option's choices are the Literal run_demo takes; typer hands a str
        database_url=database,
        model_dir=model_dir,
        job=JobConfig(steps=steps, prompts=prompts, group=group, max_new=max_new),
        console=console,
    )
    console.print(f"\nExplore: [bold]isoaudit compare {result.run_id}[/bold]")
    if serve:
        from isoaudit.cli.dashboard import dashboard

        console.print(f"dashboard: http://{host}:{port}/runs/{result.run_id}  (Ctrl-C to stop)")
        dashboard(database=result.database_url, host=host, port=port, auth=None, live_interval_ms=5000)
