"""The exit codes of launch.py, its subcommands, the driver and the Slurm job: one list.

The job script (launch/job.sh) gets the ones it tests rendered into its values block (launch/sbatch.py).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the run failed; a subcommand found no such run; sbatch / scancel refused
    CONFIG_ERROR = 2  # a config error (every problem named) or a usage error: nothing was started
    REQUEUE = 3  # the driver saved a checkpoint on SIGUSR1 / must_save_by: the job script requeues the job
    HUNG = 4  # a driver wait passed its deadline (deadlines.*): status HUNG, the stuck phase and actor named
    USR1_KILLED = 138  # 128 + SIGUSR1: the driver died of it before its handler was installed (requeued too)
    INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C (the driver checkpoints first; a follow / wait just stops)
    TERMINATED = 143  # 128 + SIGTERM: the driver checkpointed and stopped
