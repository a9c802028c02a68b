"""Draws the benchmarks page's plots (docs/benchmarks/*.png) from its tables' figures, copied here as data.

    PYTHONPATH=. python docs/benchmarks/plots.py      # from the dev venv (matplotlib); commit the PNGs

The figures are the page's: change them there and here together (the page states where each was measured).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent

# docs/benchmarks/index.md, "The real model": job -> (metric, before, after, higher is better)
REAL_MODEL = {
    "LoRA SFT\n(exact match)": (0.00, 0.41, True),
    "GRPO\n(mean reward)": (0.16, 0.78, True),
    "agent GRPO\n(Lockers reward)": (0.17, 0.54, True),
    "agent GRPO\n(follows the note)": (0.50, 0.88, True),
    "QAT int4 + LoRA\n(loss)": (5.51, 0.72, False),
    "QLoRA NF4\n(loss)": (4.89, 0.85, False),
    "distillation\n(loss)": (12.95, 6.16, False),
}
# "Generation": new tokens -> host CPU ms/token (lazy, replayed decode step, device loop), XLA:CPU, 30-layer Llama
GENERATION_HOST_MS = {24: (40.6, 2.68, 1.01), 72: (52.1, 3.45, 0.40), 256: (49.5, 3.72, 0.11)}
# "Training step host time": part -> (lazy, replay_steps) seconds, SmolLM2-135M LoRA, XLA:CPU
STEP_HOST_S = {
    "forward + loss": (0.123, 0.010),
    "backward": (0.003, 0.001),
    "optimizer": (0.117, 0.021),
    "sync": (0.034, 0.013),
    "zero_grad, schedule,\nloop, logging": (0.008, 0.008),
}
STEP_HOST_TOTAL_S = (0.294, 0.052)


def real_model(path: Path) -> None:
    widths = [sum(v[2] for v in REAL_MODEL.values()), sum(not v[2] for v in REAL_MODEL.values())]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": widths})
    for ax, higher in zip(axes, (True, False), strict=True):
        jobs = {k: v for k, v in REAL_MODEL.items() if v[2] == higher}
        x = range(len(jobs))
        ax.bar([i - 0.2 for i in x], [v[0] for v in jobs.values()], 0.4, label="before", color="#b0b0b0")
        ax.bar([i + 0.2 for i in x], [v[1] for v in jobs.values()], 0.4, label="after", color="#3f51b5")
        ax.set_xticks(list(x), list(jobs), fontsize=8)
        ax.set_title("held-out, higher is better" if higher else "held-out loss, lower is better", fontsize=9)
        for i, (before, after, _) in enumerate(jobs.values()):
            ax.annotate(f"{before:g} -> {after:g}", (i, max(before, after)), ha="center", va="bottom", fontsize=7)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, offline, 2-core CPU (make test-real)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def generation(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    tokens = list(GENERATION_HOST_MS)
    for i, (label, color) in enumerate((("lazy", "#b0b0b0"), ("replayed decode step", "#7986cb"),
                                        ("device loop", "#3f51b5"))):
        ax.plot(tokens, [GENERATION_HOST_MS[t][i] for t in tokens], "o-", label=label, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("new tokens per call")
    ax.set_ylabel("host CPU ms per token")
    ax.set_title("Generation on XLA:CPU, 30-layer Llama of width 64, batch 8", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_host_time(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    sides = ("lazy", "replay_steps")
    left = [0.0, 0.0]
    colors = ("#3f51b5", "#7986cb", "#e57373", "#ffb74d", "#b0b0b0")
    for (part, values), color in zip(STEP_HOST_S.items(), colors, strict=True):
        ax.barh(sides, values, left=left, label=part.replace("\n", " "), color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for i, total in enumerate(STEP_HOST_TOTAL_S):  # the medians of the runs' totals, as the table gives them
        ax.annotate(f"{total:.3f} s", (left[i], i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel("host seconds per step")
    ax.set_title("SmolLM2-135M LoRA step on XLA:CPU: the host's time by part", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.margins(x=0.15)
    ax.set_ylim(-0.6, 2.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    real_model(HERE / "real_model.png")
    generation(HERE / "generation_host.png")
    step_host_time(HERE / "step_host_time.png")
    print("wrote", ", ".join(p.name for p in sorted(HERE.glob("*.png"))))
