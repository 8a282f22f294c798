#!/usr/bin/env python
"""grpo-launcher: compose → RunSpec → validate → plan → execute.

    python launch.py                                   # tiny model, CPU, local Ray
    python launch.py +recipe=nanov3 cluster=slurm dry_run=true
    python launch.py status|logs|cancel RUN_NAME_OR_JOB_ID
"""

import sys

from grpo_launcher.launch import SUBCOMMANDS, execute
from grpo_launcher.launch.sweep import multirun
from grpo_launcher.plan import make_plan
from grpo_launcher.spec.compose import load_spec
from grpo_launcher.spec.errors import ConfigError


def main(overrides: list[str]) -> int:
    if overrides and overrides[0] in SUBCOMMANDS:  # status | logs | cancel  <run name or job id>
        return SUBCOMMANDS[overrides[0]](overrides[1:])
    if "-m" in overrides or "--multirun" in overrides:  # one run (one Slurm job) per point
        return multirun(overrides)
    try:
        spec = load_spec(overrides)  # Hydra compose → frozen RunSpec → every pre-flight rule
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return 2
    plan = make_plan(spec)  # nodes, devices, DP size, engines, ports, run dir: derived once
    return execute(spec, plan)  # local driver | sbatch (dry run prints, submits nothing)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
