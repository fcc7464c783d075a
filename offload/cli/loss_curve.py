"""A loss curve as a PNG, when matplotlib is installed (it is optional: `pip install matplotlib`)."""

from __future__ import annotations

from typing import Optional, Sequence


def save_loss_curve(losses: Sequence[float], path: str, title: str, floor: Optional[float] = None,
                    steps: Optional[Sequence[int]] = None) -> Optional[str]:
    """Plot loss against step (1, 2, ... unless `steps` says) into `path`; returns the path, or None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = list(steps) if steps is not None else list(range(1, len(losses) + 1))
    ax.plot(steps, losses, marker="." if len(losses) <= 60 else None, label="training loss")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", linewidth=1, label=f"best possible ({floor:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
