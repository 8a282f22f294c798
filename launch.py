#!/usr/bin/env python
"""grpo-launcher, a Hydra app: compose → RunSpec → validate → plan → execute.

    python launch.py                                   # tiny model, CPU, local Ray
    python launch.py +recipe=nanov3 cluster=slurm dry_run=true
    python launch.py --help | --cfg job | --info | -m key=a,b | --config-dir DIR
    python launch.py status|logs|cancel RUN_NAME_OR_JOB_ID
"""

import sys

from grpo_launcher.launch.app import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
