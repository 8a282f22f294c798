"""Wait until a Ray cluster has every node (and GPU) the plan asked for, or fail naming what is missing.

    python -m grpo_launcher.launch.ray_wait --nodes 2 --gpus 16 --timeout 300   (RAY_ADDRESS from env)
"""

from __future__ import annotations

import argparse
import sys
import time


def joined(nodes: int, gpus: int) -> tuple[bool, str]:
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    have_gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
    indices = sorted(k for n in alive for k in n["Resources"] if k.startswith("grpo_node_"))
    state = f"{len(alive)}/{nodes} nodes ({', '.join(indices) or '-'}), {have_gpus:g}/{gpus} GPUs"
    return len(alive) >= nodes and have_gpus >= gpus, state


def wait_for_cluster(nodes: int, gpus: int, timeout: float) -> bool:
    import ray

    deadline = time.monotonic() + timeout
    while True:  # the head may still be starting: connect with retries
        try:
            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"ray_wait: cannot reach the Ray head: {exc}", file=sys.stderr)
                return False
            time.sleep(1)
    try:
        while True:
            ok, state = joined(nodes, gpus)
            if ok:
                print(f"ray_wait: cluster ready: {state}", flush=True)
                return True
            if time.monotonic() > deadline:
                print(f"ray_wait: timed out after {timeout:.0f}s with {state}", file=sys.stderr)
                return False
            time.sleep(1)
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    sys.exit(0 if wait_for_cluster(a.nodes, a.gpus, a.timeout) else 1)


if __name__ == "__main__":
    main()
