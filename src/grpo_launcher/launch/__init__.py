"""Execute a validated plan: `local` runs the driver here, `slurm` submits the rendered sbatch script."""

from __future__ import annotations

from typing import Callable

from ..plan import Plan
from ..spec.schema import RunSpec
from .local import run_local
from .slurm import submit_slurm

EXECUTORS: dict[str, Callable[[RunSpec, Plan], int]] = {"local": run_local, "slurm": submit_slurm}


def _subcommand(name: str) -> Callable[[list[str]], int]:
    def run(args: list[str]) -> int:
        from . import cli

        return getattr(cli, name)(args)

    return run


SUBCOMMANDS = {name: _subcommand(name) for name in ("status", "logs", "cancel")}


def _rerun(args: list[str]) -> int:  # launch.py rerun RUN_DIR [key=value ...]
    from .repro import rerun

    return rerun(args)


def _export(args: list[str]) -> int:  # launch.py export RUN_DIR [--step N | --last] [--out DIR]
    from ..export import main

    return main(args)


def _eval(args: list[str]) -> int:  # launch.py eval|generate RUN_DIR|MODEL_DIR ... (launch/eval.py)
    from .eval import eval_main

    return eval_main(args)


def _generate(args: list[str]) -> int:
    from .eval import generate_main

    return generate_main(args)


SUBCOMMANDS.update(rerun=_rerun, export=_export, eval=_eval, generate=_generate)


def execute(spec: RunSpec, plan: Plan) -> int:
    print(f"grpo-launcher: run '{spec.name}' ({spec.cluster.kind.value})\n{plan.summary()}", flush=True)
    from ..spec.disk import report as disk_report  # imported here, as the memory report below

    print(disk_report(spec), flush=True)  # one checkpoint's bytes, the peak on disk, the room (spec/disk.py)
    if plan.use_gpus:  # the memory pre-flight's budget per GPU and per node (spec/memory.py)
        from ..spec.memory import report

        print(report(spec), flush=True)
    return EXECUTORS[spec.cluster.kind.value](spec, plan)
