"""The run's record: one JSON line per iteration, and a picture of the reward curve and of each stage's busy time."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: One colour per role, in pipeline order (matplotlib's tab10).
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray")


class MetricsLog:
    """Appends one JSON object per line and flushes it, so a crashed run keeps what it did."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def first_last(values: Sequence[float], k: int = 3) -> tuple[float, float]:
    """Mean of the first ``k`` and of the last ``k`` values."""
    k = min(k, len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _roles(records: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The run's roles in pipeline order (records written before ``algo`` was recorded are GRPO's)."""
    from ..algorithms import get_algorithm

    return get_algorithm(records[0].get("algo", "grpo")).roles


def _lanes(records: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> list[tuple[str, int]]:
    """(role, dp_rank) pairs that were ever busy, in pipeline order."""
    seen = {(role, dp) for r in records for role, dp, _, _ in r["busy"]}
    return sorted(seen, key=lambda lane: (roles.index(lane[0]), lane[1]))


def plot(records: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> None:
    """Reward per iteration (top), every stage's busy intervals over the run (middle), and the last
    two iterations magnified (bottom), where the stages' overlap through the broker is visible."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    t0 = records[0]["start"]
    roles = _roles(records)
    lanes = _lanes(records, roles)
    ages = any(r.get("max_age", 1) > 1 for r in records)
    versions = not ages and any(r.get("max_staleness") is not None for r in records)
    critic = "value_loss" in records[0]
    filtered = "filtered_groups" in records[0]
    policy = "kl" in records[0] and "clip_frac" in records[0]  # GRPO's own: its loss's KL term and the clip
    if ages or versions or critic or filtered or policy:
        fig, (ax_r, ax_t, ax_z, ax_x) = plt.subplots(
            4, 1, figsize=(11, 13), gridspec_kw={"height_ratios": [1.1, 1, 1, 0.9]})
    else:
        fig, (ax_r, ax_t, ax_z) = plt.subplots(3, 1, figsize=(11, 10), gridspec_kw={"height_ratios": [1.1, 1, 1]})

    its = [r["iteration"] for r in records]
    ax_r.plot(its, [r["reward"] for r in records], marker="o", label="mean reward")
    ax_r.plot(its, [r["exact"] for r in records], marker=".", linestyle="--", label="exact answers")
    ax_r.set_xlabel("iteration")
    ax_r.set_ylabel("reward")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.grid(alpha=0.3)
    ax_r.legend(loc="upper left")
    first, last = first_last([r["reward"] for r in records])
    name = records[0].get("algo", "grpo").upper()
    ax_r.set_title(title or f"{name} through the broker: reward {first:.2f} (first 3) -> {last:.2f} (last 3)")

    def timeline(ax: Any, shown: Sequence[Mapping[str, Any]]) -> None:
        for y, (role, dp) in enumerate(lanes):
            bars = [(b0 - t0, b1 - b0) for r in shown for rr, d, b0, b1 in r["busy"] if (rr, d) == (role, dp)]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=COLOURS[roles.index(role) % len(COLOURS)])
        for r in shown:  # iteration boundaries
            ax.axvline(r["start"] - t0, color="grey", linewidth=0.6, alpha=0.6)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"{role} dp{dp}" if dp or (role, 1) in lanes else role for role, dp in lanes])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first iteration started")
        ax.grid(axis="x", alpha=0.3)

    timeline(ax_t, records)
    ax_t.set_title("when each stage was busy (grey lines: iteration starts)")
    zoom = records[-2:]
    timeline(ax_z, zoom)
    left, right = zoom[0]["start"] - t0, zoom[-1]["start"] + zoom[-1]["seconds"] - t0
    ax_z.set_xlim(left, right + 0.02 * (right - left))  # the trainer finishes last: keep its end in view
    ax_z.set_title(f"the last {len(zoom)} iterations, magnified")
    if ages:
        _plot_ages(ax_x, records)
    elif versions:
        _plot_versions(ax_x, records)
    elif critic:
        _plot_critic(ax_x, records)
    elif filtered:
        _plot_filtered(ax_x, records)
    elif policy:
        _plot_policy(ax_x, records)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ages(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """Partial rollout: the groups the dock held at the end of each iteration, stacked by age."""
    its = [r["iteration"] for r in records]
    top = max(int(a) for r in records for a in r["groups_by_age"])
    bottom = [0] * len(records)
    for age in range(top + 1):
        counts = [int(r["groups_by_age"].get(str(age), 0)) for r in records]
        ax.bar(its, counts, bottom=bottom, label=f"age {age}", color=COLOURS[age % len(COLOURS)])
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_xlabel("iteration")
    ax.set_ylabel("groups")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", ncol=top + 1)
    ax.set_title("partial rollout: groups held at each iteration's end by age (iterations kept); "
                 "age >= 1 were carried over unfinished or untrained")


def _plot_versions(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """Asynchronous rollout: how many versions the trained data lagged, and stale groups dropped."""
    its = [r["iteration"] for r in records]
    ax.plot(its, [r.get("version_lag", 0.0) for r in records], marker="o", label="mean version lag of trained rows")
    ax.plot(its, [r.get("version_lag_max", 0.0) for r in records], marker=".", linestyle="--",
            label="largest version lag")
    ax.set_xlabel("iteration")
    ax.set_ylabel("versions behind")
    ax.set_ylim(-0.05, max([1.0, *(r.get("version_lag_max", 0.0) for r in records)]) + 0.4)
    ax.grid(alpha=0.3)
    bars = ax.twinx()
    bars.bar(its, [r.get("stale_dropped", 0) for r in records], alpha=0.3, color="tab:red",
             label="stale groups dropped by the dock")
    bars.set_ylabel("groups dropped")
    bars.set_ylim(bottom=0, top=max([1, *(r.get("stale_dropped", 0) for r in records)]) * 1.2)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = bars.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="upper left")
    ax.set_title("asynchronous rollout: version lag of the trained data (trainer's version - generator's) "
                 "and stale groups dropped")


def _plot_critic(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """PPO: the critic's clipped value loss per iteration, with its mean value and mean return."""
    _two_axes(ax, records, ("value_loss", "critic value loss", "tab:olive"), "value loss",
              [("value_mean", "mean value", "--", "tab:blue"), ("return_mean", "mean return", ":", "tab:red")],
              "per token", right_from_zero=False)
    ax.set_title("PPO: the critic's clipped value loss (mean over its steps), its values and the GAE returns")


def _plot_policy(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """GRPO: the mean KL to the reference (k3, the loss's KL term) and the share of clipped tokens per iteration."""
    _two_axes(ax, records, ("kl", "KL to the reference (k3)", "tab:purple"), "KL",
              [("clip_frac", "tokens clipped (share)", "--", "tab:gray")], "share of tokens", right_from_zero=True)
    ax.set_title("GRPO: how far the policy moved from the reference, and how much of each step the clip cut")


def _two_axes(ax: Any, records: Sequence[Mapping[str, Any]], left: tuple[str, str, str], left_axis: str,
              right: Sequence[tuple[str, str, str, str]], right_axis: str, *, right_from_zero: bool) -> None:
    """Per iteration: one metric (key, label, colour) on the left axis, from 0, and others (key, label, line
    style, colour) on a right one, with one legend for both."""
    its = [r["iteration"] for r in records]
    key, label, colour = left
    ax.plot(its, [r[key] for r in records], marker="o", color=colour, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel(left_axis)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    for key, label, style, colour in right:
        twin.plot(its, [r[key] for r in records], linestyle=style, color=colour, label=label)
    twin.set_ylabel(right_axis)
    if right_from_zero:
        twin.set_ylim(bottom=0)
    _legend_above_the_curves(ax, twin)


def _legend_above_the_curves(ax: Any, twin: Any) -> None:
    """One legend for a panel's two y axes, in a band left free above every curve (wherever they peak)."""
    for axis in (ax, twin):
        low, high = axis.get_ylim()
        axis.set_ylim(low, low + (high - low) * 1.3)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="upper center", ncol=len(lines + more), framealpha=0.9)


def _plot_filtered(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """DAPO: groups judged by the advantage stage per iteration, kept and filtered (then replaced)."""
    its = [r["iteration"] for r in records]
    dropped = [r["filtered_groups"] for r in records]
    kept = [r["judged_groups"] - d for r, d in zip(records, dropped)]
    ax.bar(its, kept, color="tab:green", label="groups kept (trained)")
    ax.bar(its, dropped, bottom=kept, color="tab:red", label="groups filtered (all n rewards equal), replaced")
    ax.set_xlabel("iteration")
    ax.set_ylabel("groups")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title("DAPO dynamic sampling: groups judged per iteration")
