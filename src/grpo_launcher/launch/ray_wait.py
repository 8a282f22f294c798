"""Wait until a Ray cluster has every node (and GPU) the plan asked for, or fail naming what is missing;
and, after the driver, record where every actor ran.

    python -m grpo_launcher.launch.ray_wait --nodes 2 --gpus 16 --timeout 300 --node-names n1 n2
    python -m grpo_launcher.launch.ray_wait --placement RUN_DIR/logs/placement-JOB.json --node-names n1 n2

RAY_ADDRESS comes from the environment (the sbatch script exports the head's GCS address). Node i of the
allocation carries the custom resource `grpo_node_<i>`, so a Ray node maps back to its Slurm node name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import ray
from ray._private.state import state as ray_state


def node_index(resources: dict) -> int | None:
    for key in resources:
        if key.startswith("grpo_node_") and key[len("grpo_node_"):].isdigit():
            return int(key[len("grpo_node_"):])
    return None


def joined(nodes: int, gpus: int, names: list[str] | None = None) -> tuple[bool, str]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    have_gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
    present = {node_index(n["Resources"]) for n in alive} - {None}
    missing = [i for i in range(nodes) if i not in present]
    label = (lambda i: f"{names[i]} (grpo_node_{i})") if names and len(names) == nodes else (lambda i: f"grpo_node_{i}")
    state = f"{len(alive)}/{nodes} nodes, {have_gpus:g}/{gpus} GPUs"
    if missing:
        state += "; missing: " + ", ".join(label(i) for i in missing)
    return not missing and len(alive) >= nodes and have_gpus >= gpus, state


def connect(timeout: float) -> bool:
    address = os.environ.get("RAY_ADDRESS", "auto")
    deadline = time.monotonic() + timeout
    while True:  # the head may still be starting: connect with retries
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return True
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"ray_wait: cannot reach the Ray head at {address}: {exc}", file=sys.stderr)
                return False
            time.sleep(1)


def wait_for_cluster(nodes: int, gpus: int, timeout: float, names: list[str] | None = None) -> bool:
    t0 = time.monotonic()
    if not connect(timeout):
        return False
    try:
        while True:
            ok, state = joined(nodes, gpus, names)
            if ok:
                print(f"ray_wait: cluster ready after {time.monotonic() - t0:.1f}s: {state}", flush=True)
                return True
            if time.monotonic() - t0 > timeout:
                print(f"ray_wait: timed out after {timeout:.0f}s with {state}", file=sys.stderr)
                return False
            time.sleep(0.5)
    finally:
        ray.shutdown()


def placement(names: list[str] | None = None) -> dict:
    """Every actor the run created (dead ones included: GCS keeps them) → the Slurm node it ran on."""
    node_of = {}
    for n in ray.nodes():
        i = node_index(n["Resources"])
        node_of[n["NodeID"]] = {"grpo_node": i, "slurm_node": names[i] if names and i is not None and i < len(names)
                                else None, "ip": n.get("NodeManagerAddress")}
    actors = []
    for actor_id, a in ray_state.actor_table(None).items():
        nid = (a.get("Address") or {}).get("NodeID")
        where = node_of.get(nid, {"grpo_node": None, "slurm_node": None, "ip": None})
        actors.append({"actor_id": actor_id, "class": a.get("ActorClassName"), "state": a.get("State"),
                       "pid": a.get("Pid"), "node_id": nid, **where})
    by_node = Counter((x["slurm_node"] or f"grpo_node_{x['grpo_node']}", x["class"]) for x in actors)
    return {"nodes": list(node_of.values()), "actors": actors,
            "summary": {f"{node}/{cls}": count for (node, cls), count in sorted(by_node.items(), key=str)}}


def write_placement(path: Path, names: list[str] | None) -> bool:
    if not connect(30):
        return False
    try:
        info = placement(names)
    finally:
        ray.shutdown()
    path.write_text(json.dumps(info, indent=1) + "\n")
    per_node: dict[str, list[str]] = {}
    for key, count in info["summary"].items():
        node, cls = key.split("/", 1)
        per_node.setdefault(node, []).append(f"{cls}×{count}")
    print("placement: " + "; ".join(f"{node}: {', '.join(v)}" for node, v in sorted(per_node.items()))
          + f" ({path})", flush=True)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--node-names", nargs="*", default=None)
    ap.add_argument("--placement", type=Path, help="write where each actor ran to this JSON file, then exit")
    a = ap.parse_args()
    if a.placement:
        sys.exit(0 if write_placement(a.placement, a.node_names) else 1)
    if a.nodes is None:
        ap.error("--nodes is required")
    sys.exit(0 if wait_for_cluster(a.nodes, a.gpus, a.timeout, a.node_names) else 1)


if __name__ == "__main__":
    main()
