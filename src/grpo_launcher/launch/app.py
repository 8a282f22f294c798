"""`launch.py` as a Hydra app: Hydra's own flags, our typed schema, and our all-at-once `config error`.

    python launch.py [key=value ...]                 one run: compose → spec → validate → plan → execute
    python launch.py -m key=a,b ...                  a sweep (one run per point; hydra/launcher=grpo)
    python launch.py --help                          groups, options and every key with its doc
    python launch.py --cfg job|hydra|all [--resolve] [--package PKG]    the composed config (Hydra)
    python launch.py --info [all|config|defaults|defaults-tree|plugins|searchpath]
    python launch.py --shell-completion install=bash      (eval "$(python launch.py -sc install=bash)")
    python launch.py --config-dir DIR ...            the user's own recipe/, model/, env/ ... YAMLs (searched first)
    python launch.py -cn NAME ...                    another primary config (conf/ or --config-dir)
    python launch.py status|logs|cancel RUN          runs by name, job id or run dir
    python launch.py export RUN_DIR [--step N]       a checkpoint as an HF model directory
    python launch.py rerun RUN_DIR [key=value ...]   a recorded run's spec again, as a new run

Flags are Hydra's (its argument parser); what Hydra prints (--cfg, --info, --hydra-help, completion) it prints
itself, after our composition check. A single run does not use Hydra's run dir: `hydra.run.dir` is refused
with the reason (the run dir is output_root/name).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional

import hydra
from hydra._internal.utils import get_args_parser

from .. import export
from ..exit_codes import ExitCode
from ..spec.compose import CONF_DIR, SELECTORS, ConfigSource, compose, dotted_keys, register_schema, to_spec
from ..spec.docs import render_key_docs
from ..spec.errors import ConfigError, Violation
from ..tracking.store import tracking_line
from . import cli, execute, repro
from .eval import eval_main, generate_main
from .preflight import Launch, preflight, real_launch_problems
from .sbatch import script_path
from .sweep import multirun

HYDRA_PRINTS = ("cfg", "info", "hydra_help", "shell_completion")


def parse_flags(argv: list[str]) -> tuple[Optional[argparse.Namespace], int]:
    """Hydra's own argument parser (the flags a Hydra app takes): (flags, 0), or (None, exit code) when argparse
    already answered (--version; a usage error, exit 2)."""
    try:
        return get_args_parser().parse_args(argv), ExitCode.OK
    except SystemExit as exc:
        return None, ExitCode.OK if not exc.code else ExitCode.CONFIG_ERROR


def config_source(args: argparse.Namespace) -> ConfigSource:
    """-cp/--config-path (primary dir; conf/ stays searchable), -cn/--config-name, -cd/--config-dir, hydra.searchpath."""
    name = args.config_name or "config"
    conf_dir = Path(args.config_path).resolve() if args.config_path else CONF_DIR
    user = Path(args.config_dir).resolve() if args.config_dir else None
    if user is not None and not (conf_dir / f"{name}.yaml").exists() and (user / f"{name}.yaml").exists():
        conf_dir = user  # -cn NAME names the user's own primary config: it is the primary dir then
    extra = [str(user)] if user is not None and user != conf_dir else []
    if conf_dir != CONF_DIR:
        extra.append(str(CONF_DIR))
    return ConfigSource(conf_dir=conf_dir, config_name=name, search_path=tuple(extra))


def main(argv: list[str]) -> int:
    """launch.py: a Ctrl-C where no run handles it (pre-flight, a subcommand, a run's start before its driver's
    handler) ends in one line and exit 130, not a KeyboardInterrupt traceback."""
    try:
        return dispatch(argv)
    except KeyboardInterrupt:
        print("\ngrpo-launcher: interrupted (Ctrl-C); `python launch.py status` shows where any run it started "
              "stands", file=sys.stderr, flush=True)
        return ExitCode.INTERRUPTED


def dispatch(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:  # status | logs | cancel  <run name, job id or run dir>
        return cli.quiet_on_closed_pipe(SUBCOMMANDS[argv[0]])(argv[1:])
    typo = subcommand_typo(argv, list(SUBCOMMANDS))
    if typo is not None:
        print(typo.render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    args, code = parse_flags(argv)
    if args is None:
        return code
    if args.help:
        print(app_help(config_source(args)))
        return ExitCode.OK
    missing = [Violation("config_dirs", (flag,), f"{value} is not a directory (Hydra would only warn, and the run "
                         "would go on without your configs)", f"point {flag} at a directory of config groups")
               for flag, value in (("--config-dir", args.config_dir), ("--config-path", args.config_path))
               if value and not Path(value).is_dir()]
    if missing:
        print(ConfigError(missing).render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if args.experimental_rerun:
        print("config error: --experimental-rerun is not supported: relaunch with the run's overrides "
              "(output_root/name/spec.yaml holds the resolved spec)", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    source = config_source(args)
    if any(getattr(args, flag) for flag in HYDRA_PRINTS):  # Hydra prints these itself
        return hydra_prints(argv, args, source)
    if args.multirun:
        return multirun(args.overrides, source, hydra_flags(args))
    return single_run(args.overrides, source)


def subcommand_typo(argv: list[str], commands: list[str]) -> Optional[ConfigError]:
    """`launch.py staus NAME`: a first word that is no override (no '=') nor flag, close to a subcommand."""
    if not argv or "=" in argv[0] or argv[0].startswith("-") or argv[0] in {*SELECTORS, *dotted_keys()}:
        return None  # `launch.py dry_run`, `launch.py loss`: a key without its value (the override check says so)
    near = difflib.get_close_matches(argv[0], commands, n=1, cutoff=0.8)
    if not near:
        return None  # an override without '=': the override check says how to write it
    return ConfigError([Violation("subcommand", (argv[0],), f"'{argv[0]}' is not a command",
                                  f"did you mean '{near[0]}'? python launch.py {shlex.join([near[0], *argv[1:]])} "
                                  f"(commands: {', '.join(commands)})")])


def single_run(overrides: list[str], source: Optional[ConfigSource] = None, saved: Optional[Path] = None) -> int:
    """argv's overrides → pre-flight → execute (`saved`: launch.py rerun's spec.yaml)."""
    try:
        launch = preflight(overrides, source, saved)  # every problem at once; nothing started or written
    except ConfigError as err:
        print(err.render(), file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if launch.spec.dry_run:  # prints only: a reader gone (`| head`) ends it quietly
        return cli.quiet_on_closed_pipe(lambda _: dry_run(launch))([])
    if launch.spec.logging.mlflow:
        print(tracking_line(launch.spec, launch.plan.tracking_uri), flush=True)
    return execute(launch)  # local driver | sbatch


def dry_run(launch: Launch) -> int:
    """The plan and the exact sbatch script; nothing started, submitted or written."""
    if launch.spec.logging.mlflow:
        print(tracking_line(launch.spec, launch.plan.tracking_uri), flush=True)
    rc = execute(launch)
    dry_run_notes(launch)
    return rc


def dry_run_notes(launch: Launch) -> None:
    """What a real launch of a dry run's spec would write, and what it would be refused for."""
    if launch.spec.cluster.kind.value == "slurm":
        print(f"dry run: nothing was written: a real launch writes the script above to {script_path(launch.plan)} "
              "and submits it with sbatch")
    problems = real_launch_problems(launch.spec)
    if problems:  # the rules a dry run skips (this build's gaps, local paths, GPUs, the run dir's checkpoints)
        print(f"dry run: a real launch of this spec would be refused ({len(problems)} problem"
              f"{'s' if len(problems) > 1 else ''}):\n" + "\n".join(v.render() for v in problems))


# launch.py SUBCOMMAND ...: status|logs|cancel RUN (cli.py), rerun RUN_DIR (repro.py, through single_run),
# export RUN_DIR (export.py), eval|generate RUN_DIR|MODEL_DIR (eval.py)
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {
    "status": cli.status, "logs": cli.logs, "cancel": cli.cancel,
    "rerun": lambda args: repro.rerun(args, single_run), "export": export.main,
    "eval": eval_main, "generate": generate_main,
}


def hydra_flags(args: argparse.Namespace) -> list[str]:
    """The config-location flags, for the Hydra app a sweep runs."""
    out = []
    for flag, value in (("--config-path", args.config_path), ("--config-name", args.config_name),
                        ("--config-dir", args.config_dir)):
        if value:
            out += [flag, str(Path(value).resolve()) if flag != "--config-name" else value]
    return out


def hydra_prints(argv: list[str], args: argparse.Namespace, source: ConfigSource) -> int:
    """--cfg/--info/--hydra-help/--version/completion: Hydra prints them, once the config composes."""
    if (args.cfg or args.info) and not args.shell_completion:
        try:
            to_spec(compose(args.overrides, source=source))  # composition errors as ours (exit 2, key named)
        except ConfigError as err:
            print(err.render(), file=sys.stderr)
            return ExitCode.CONFIG_ERROR
    register_schema()
    app = hydra.main(config_path=str(source.conf_dir), config_name=source.config_name, version_base="1.3")(_never)
    flags = list(argv)
    for override in args.overrides:  # Hydra's parser takes its overrides as one run of positionals: keep them last
        flags.remove(override)
    saved, sys.argv = sys.argv, [sys.argv[0] or "launch.py", *flags, *args.overrides, *source.overrides()]
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or ExitCode.OK) if not isinstance(exc.code, str) else ExitCode.FAILED
    finally:
        sys.argv = saved
    return ExitCode.OK


def _never(cfg: object) -> None:  # Hydra calls the task only for a run, and runs never come here
    raise RuntimeError("hydra_prints ran a task")


def group_options(source: ConfigSource) -> dict[str, list[str]]:
    """Every config group and its options, over conf/ and the user's config dirs."""
    dirs = [source.conf_dir, *(Path(p.removeprefix("file://")) for p in source.search_path if "pkg://" not in p)]
    groups: dict[str, set[str]] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("*/*.yaml")):
            groups.setdefault(path.parent.name, set()).add(path.stem)
    return {g: sorted(o) for g, o in sorted(groups.items())}


def app_help(source: ConfigSource) -> str:
    usage = (__doc__ or "").split("\n\n")[1]
    groups = "\n".join(f"  {g:9s} {', '.join(opts)}" for g, opts in group_options(source).items())
    return (f"grpo-launcher: Hydra config groups → one typed run spec → every pre-flight rule → local | Slurm\n\n"
            f"usage:\n{usage}\n\nConfig groups (GROUP=OPTION; presets: +recipe=NAME; your own: --config-dir DIR):\n"
            f"{groups}\n\nKeys (KEY=VALUE; type = default, then what it means):\n{render_key_docs()}\n\n"
            "Hydra's own help: python launch.py --hydra-help")
