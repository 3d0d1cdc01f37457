"""PNG plots of a load test (matplotlib, no display needed), one line per routing policy:

    ttft.png        TTFT distribution (ECDF): all requests, then split by cache state
    throughput.png  answered requests/s and generated tokens/s over time
    reuse.png       reuse ratio over time (cached prompt tokens / all prompt tokens, cumulative)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a headless runner

import matplotlib.pyplot as plt  # noqa: E402

from loadtest.stream import CACHE_STATES  # noqa: E402

STATE_STYLE = {"cold": ":", "partial": "--", "full": "-"}


def write_plots(runs: dict[str, list[dict]], out_dir: Path) -> list[Path]:
    """runs: policy -> its records. Returns the PNGs written (a plot with no data is skipped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    answered = {name: sorted((r for r in rows if r["kind"] == "request" and r["ok"]), key=lambda r: r["t_end"])
                for name, rows in runs.items()}
    written = []
    for name, draw in (("ttft.png", _ttft), ("throughput.png", _throughput), ("reuse.png", _reuse)):
        fig = draw(answered)
        if fig is not None:
            fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(out_dir / name)
    return written


def _ecdf(ax, values: list[float], **style) -> bool:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return False
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", **style)
    return True


def _ttft(answered: dict[str, list[dict]]):
    if not any(r["ttft_s"] is not None for rows in answered.values() for r in rows):
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (name, rows) in enumerate(answered.items()):
        color = f"C{i}"
        _ecdf(left, [r["ttft_s"] for r in rows], color=color, label=f"{name} (n={len(rows)})")
        for state in CACHE_STATES:
            picked = [r["ttft_s"] for r in rows if r["cache_state"] == state]
            _ecdf(right, picked, color=color, linestyle=STATE_STYLE[state], label=f"{name} {state} (n={len(picked)})")
    for ax, title in ((left, "TTFT, all requests"), (right, "TTFT by cache state")):
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("share of requests")
    return fig


def _rolling(rows: list[dict], t0: float, value, points: int = 60) -> tuple[list[float], list[float], float]:
    """Rate over a trailing window (a tenth of the run, at least 5 s): at a few requests per second,
    per-second bins are mostly noise."""
    span = rows[-1]["t_end"] - t0
    window = max(5.0, span / 10)
    ends = [r["t_end"] - t0 for r in rows]
    xs = [min(window, span) + i * max(span - window, 0.0) / (points - 1) for i in range(points)]
    ys = [sum(value(r) for r, e in zip(rows, ends) if x - window < e <= x) / window for x in xs]
    return xs, ys, window


def _throughput(answered: dict[str, list[dict]]):
    if not any(answered.values()):
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for i, (name, rows) in enumerate(answered.items()):
        if not rows:
            continue
        t0 = min(r["t_start"] for r in rows)
        xs, ys, window = _rolling(rows, t0, lambda r: 1.0)
        top.plot(xs, ys, color=f"C{i}", label=f"{name} ({window:.0f} s window)")
        xs, ys, _ = _rolling(rows, t0, lambda r: r["completion_tokens"])
        bottom.plot(xs, ys, color=f"C{i}", label=name)
    top.set_ylabel("answered requests/s")
    bottom.set_ylabel("generated tokens/s")
    bottom.set_xlabel("seconds since the first request")
    top.set_title("Throughput over time")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _reuse(answered: dict[str, list[dict]]):
    if not any(answered.values()):
        return None
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (name, rows) in enumerate(answered.items()):
        if not rows:
            continue
        t0 = min(r["t_start"] for r in rows)
        cached = prompt = 0
        xs, ys = [], []
        for r in rows:
            cached += r["cached_tokens"]
            prompt += r["prompt_tokens"]
            xs.append(r["t_end"] - t0)
            ys.append(cached / prompt if prompt else 0.0)
        ax.plot(xs, ys, color=f"C{i}", label=f"{name} (final {ys[-1]:.2f})")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Reuse ratio over time (cumulative)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig
