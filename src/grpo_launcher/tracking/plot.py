"""The run's reward / validation curve as a PNG in the run dir (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from . import metric_names as M

CURVES = ((M.TRAIN_REWARD_MEAN, "train reward"), (M.VAL_REWARD_MEAN, "validation reward"))


def plot_curves(series: dict[str, list[tuple[int, float]]], out: Path, title: str) -> Path | None:
    """series: metric key → [(step, value)]; draws the CURVES present. None when there is nothing to draw."""
    drawn = [(key, label) for key, label in CURVES if series.get(key)]
    if not drawn:
        return None
    import matplotlib  # here: heavy, and only an end of run draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg")

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for key, label in drawn:
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        from matplotlib.ticker import MaxNLocator  # (the same)

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = out.with_name(f".{out.name}.tmp.png")
        fig.savefig(tmp)
        tmp.replace(out)
    finally:
        plt.close(fig)
    return out
