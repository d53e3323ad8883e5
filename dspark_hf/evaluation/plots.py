"""Figures (matplotlib, written as PNG): eval results, threshold sweeps, STS reliability diagrams."""

from __future__ import annotations

from pathlib import Path

import torch

from ..installs import missing_package
from ..training.calibration import cumulative, expected_calibration_error, survival_targets
from .metrics import format_tau


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib  # imported when a figure is drawn: slow to import, and most calls draw none
    except ImportError:
        raise missing_package("matplotlib", "Drawing plots") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_eval(results: dict | list[tuple[str, dict]], out_dir: str | Path) -> list[Path]:
    """Position-wise conditional acceptance per domain (paper Fig. 2) and tau per domain. `results` is one eval
    result or a list of (label, result) to compare drafts (e.g. DSpark vs the DFlash-style ablation)."""
    plt = pyplot()
    runs = results if isinstance(results, list) else [("draft", results)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    domains = sorted({d for _, r in runs for d in r["domains"]})
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        for label, r in runs:
            ca = r["domains"].get(domain, {}).get("conditional_acceptance") or []
            ks = [k + 1 for k, v in enumerate(ca) if v is not None]
            ax.plot(ks, [ca[k - 1] for k in ks], marker="o", label=label)
        ax.set_title(domain)
        ax.set_xlabel("draft position k")
        ax.set_xticks(range(1, 1 + max(len(r["overall"]["conditional_acceptance"]) for _, r in runs)))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conditional acceptance")
    axes[0][-1].legend()
    fig.suptitle("Position-wise conditional acceptance")
    fig.tight_layout()
    paths = [out_dir / "conditional_acceptance.png"]
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(domains), 3.4))
    width = 0.8 / len(runs)
    for i, (label, r) in enumerate(runs):
        taus = [r["domains"].get(d, {}).get("acceptance_length") for d in domains]  # None: no round, no tau
        bars = ax.bar([j + i * width for j in range(len(domains))], [t or 0 for t in taus], width, label=label)
        ax.bar_label(bars, labels=[format_tau(t) for t in taus], fontsize=8)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(domains))], domains)
    ax.set_ylabel("acceptance length tau")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "acceptance_length.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def plot_heldout_acceptance(reports: list[tuple[str, dict]], out_dir: str | Path) -> Path:
    """Held-out acceptance 1 - TV by draft position for each (label, heldout.json report) from `dspark train`:
    the suffix decay a sequential head removes, without the few-sample noise of greedy acceptance at late positions."""
    if not reports:
        raise ValueError("plot_heldout_acceptance needs at least one (label, heldout report).")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for label, r in reports:
        acc = r["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{label}: expected tau "
                f"{r['expected_tau_from_acceptance']:.2f}, {r['sequences']} sequences")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance 1 - TV")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("Held-out acceptance by position")
    fig.tight_layout()
    path = Path(out_dir) / "heldout_acceptance.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_threshold_sweep(sweep: dict, out_dir: str | Path) -> Path:
    """Paper Fig. 5: accepted and rejected tokens per step (bars) and acceptance rate (line) per threshold."""
    plt = pyplot()
    domains = list(sweep)
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        rows = sweep[domain]
        xs = list(range(len(rows)))
        accepted = [r["tokens_per_step"] - 1 for r in rows]
        rejected = [r["rejected_per_step"] for r in rows]
        ax.bar(xs, accepted, label="accepted / step")
        ax.bar(xs, rejected, bottom=accepted, hatch="//", alpha=0.5, label="rejected / step")
        ax.set_xticks(xs, [f"{r['threshold']:.1f}" for r in rows])
        ax.set_xlabel("confidence threshold")
        ax.set_ylabel("draft tokens per step")
        ax.set_title(domain)
        twin = ax.twinx()
        # a gap where nothing was verified
        rates = [float("nan") if r["acceptance_rate"] is None else r["acceptance_rate"] for r in rows]
        twin.plot(xs, rates, color="black", marker="o", label="acceptance rate")
        twin.set_ylim(0, 1)
        twin.set_ylabel("acceptance rate")
        if ax is axes[0][0]:  # one legend for the bars and the line of the twin axes
            handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
            ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "threshold_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reliability_diagram(logits, verified, accepted, before, after, path, bins: int = 10) -> None:
    """Predicted prefix-survival vs observed acceptance, before and after STS (paper Fig. 6)."""
    plt = pyplot()
    logits = torch.as_tensor(logits, dtype=torch.double)
    y, mask = survival_targets(logits, torch.as_tensor(verified), torch.as_tensor(accepted))
    fig, ax = plt.subplots(figsize=(4.2, 4.2))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    for label, temps in (("raw", before), ("STS", after)):
        pred = cumulative(logits, torch.as_tensor(temps, dtype=torch.double))[mask]
        obs = y[mask]
        index = (pred * bins).long().clamp(max=bins - 1)
        xs, ys = [], []
        for b in range(bins):
            sel = index == b
            if sel.sum() >= 5:
                xs.append(float(pred[sel].mean()))
                ys.append(float(obs[sel].mean()))
        ece = expected_calibration_error(pred, obs)
        ax.plot(xs, ys, marker="o", label=f"{label} (ECE {ece:.1%})")
    counts = torch.histc(cumulative(logits, torch.as_tensor(after, dtype=torch.double))[mask].float(), bins, 0, 1)
    ax.bar([(b + 0.5) / bins for b in range(bins)], (counts / counts.max()).tolist(), width=1 / bins, alpha=0.15,
           color="grey")
    ax.set_xlabel("predicted prefix survival")
    ax.set_ylabel("observed acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
