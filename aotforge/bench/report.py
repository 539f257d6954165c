"""The results as a Markdown table (stdout), JSON, and a PNG bar chart when matplotlib is there."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

from aotforge.bench.measure import NOISY_SPREAD, spread
from aotforge.bench.runner import Result

COLUMNS = (
    "workload", "mode", "backend", "status", "median ms", "spread", "speedup", "vs inductor",
    "first call s", "peak MiB", "graphs", "GB/s (of copy)", "note",
)
BANDWIDTH = "GB/s (of copy)"  # left out on CPU: a copy there is no ceiling for a step's bytes


def _number(value: float | None, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}{suffix}"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.{3 if value < 0.1 else 2}f}x"


def _row(result: Result) -> list[str]:
    graphs = ""
    if result.graphs is not None:
        graphs = str(result.graphs) + (f" ({result.graph_breaks} breaks)" if result.graph_breaks else "")
    bandwidth = ""
    if result.gbps is not None:
        bandwidth = f"{result.gbps:.0f}"
        if result.copy_fraction is not None:
            bandwidth += f" ({100 * result.copy_fraction:.0f}%)"
    median_digits = 3 if result.median_ms is not None and result.median_ms < 10 else 1
    return [
        result.workload, result.mode, result.backend, result.status,
        _number(result.median_ms, median_digits),
        "" if spread(result.times_ms) is None else f"±{100 * spread(result.times_ms):.0f}%",
        _ratio(result.speedup), _ratio(result.vs_inductor), _number(result.compile_s, 1 if (result.compile_s or 0) >= 1 else 2),
        _number(None if result.peak_bytes is None else result.peak_bytes / 2**20, 0),
        graphs, bandwidth, "; ".join(filter(None, [result.noisy, result.reason])).replace("|", "/"),
    ]


def table(results: Sequence[Result], bandwidth: bool = True) -> str:
    """A Markdown table, one row per workload, mode and backend (``bandwidth``: with the
    GB/s column, for GPUs), then one geometric-mean row per backend (:func:`geomeans`) when
    two or more workloads and modes were timed by every backend."""
    keep = [i for i, name in enumerate(COLUMNS) if bandwidth or name != BANDWIDTH]
    columns = [COLUMNS[i] for i in keep]
    rows = [_row(result) for result in results]
    summary = geomeans(results)
    if summary and summary[0]["rows"] >= 2:
        rows += [_geomean_row(entry) for entry in summary]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
    return "\n".join(lines)


def _geomean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def geomeans(results: Sequence[Result]) -> list[dict[str, Any]]:
    """Per backend, geometric means over the workloads and modes that EVERY backend of the run
    timed (so that the backends' means are over the same rows): speedup over eager, ratio to
    inductor, and first-call seconds. ``left_out``: the backend's rows that were not timed
    (WRONG, FAILED, SKIPPED), which leave that workload and mode out of every mean. [] when no
    row was timed by every backend."""
    backends = list(dict.fromkeys(r.backend for r in results if r.backend != "-"))
    timed: dict[tuple[str, str], dict[str, Result]] = {}
    for result in results:
        timed.setdefault((result.workload, result.mode), {})
        if result.median_ms:
            timed[(result.workload, result.mode)][result.backend] = result
    common = [key for key, rows in timed.items() if all(b in rows for b in backends)]
    if not backends or not common:
        return []
    summary = []
    for backend in backends:
        rows = [timed[key][backend] for key in common]
        summary.append({
            "backend": backend,
            "rows": len(common),
            "speedup": _geomean([r.speedup for r in rows]),
            "vs_inductor": _geomean([r.vs_inductor for r in rows]),
            "first_call_s": _geomean([r.compile_s for r in rows]),
            "left_out": sum(1 for key, by_backend in timed.items() if backend not in by_backend),
        })
    return summary


def _geomean_row(entry: dict[str, Any]) -> list[str]:
    note = f"{entry['left_out']} row(s) not timed: left out of every mean" if entry["left_out"] else ""
    first = entry["first_call_s"]
    return [
        "geomean", f"{entry['rows']} rows", entry["backend"], "", "", "",
        _ratio(entry["speedup"]), _ratio(entry["vs_inductor"]),
        _number(first, 1 if (first or 0) >= 1 else 2), "", "", "", note,
    ]


LEGEND = (
    "Every backend of a workload and mode is timed in alternating rounds (one batch each per "
    "round, the order rotated; a step under {min_batch_ms:g} ms is timed as a batch of steps). "
    "median ms: one step (training: forward + backward; inference: forward under no_grad), the "
    "median over the rounds; spread: half the interquartile range over the rounds, over the "
    "median; speedup: eager's time / this one's within a round, the median over rounds; vs "
    "inductor: the same against inductor (>1 is faster than inductor); first call s: wall time "
    "of the first step, compilation included; peak MiB: {memory} over the warm-up steps, less "
    "what it was before this backend's copy of the model was made; graphs: FX graphs Dynamo "
    "compiled (and graph breaks); geomean: per backend, geometric means of speedup, vs inductor "
    "and first call s over the workloads and modes every backend timed. NOISY (note): the row's "
    "times, or its per-round ratio to "
    f"eager or inductor, spread over ±{100 * NOISY_SPREAD:.0f}%: not a stable reading on this "
    "machine now."
)
LEGEND_BANDWIDTH = (
    " GB/s: the fewest bytes a micro kernel must move per step over its median time, and that "
    "as a share of a device-to-device copy's bandwidth."
)


def noisy_summary(results: Sequence[Result], meta: dict[str, Any]) -> str:
    """One line on the NOISY rows and what to do; "" when there are none."""
    noisy = [r for r in results if r.noisy]
    if not noisy:
        return ""
    timed = sum(1 for r in results if r.median_ms is not None)
    load = meta.get("load_average")
    busy = f" (load average {load:g} on {meta.get('cpu_count', '?')} CPUs at the start)" if load is not None else ""
    return (f"{len(noisy)} of {timed} timed rows are NOISY{busy}: their rounds disagree by more than "
            f"±{100 * NOISY_SPREAD:.0f}% even after the extra rounds --stabilize allowed; read their "
            "times and ratios as rough. A quieter machine, more --repeat or a longer --stabilize "
            "gives steadier numbers.")


def write_json(path: Path, meta: dict[str, Any], results: Sequence[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [dataclasses.asdict(result) for result in results],
               "geomeans": geomeans(results)}
    path.write_text(json.dumps(_finite(payload), indent=1, default=str, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """Strict JSON has no inf/NaN: write them as the strings "inf" / "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


NO_CHART = ("no chart written: it needs matplotlib, which the `bench` extra installs "
            "(pip install -e \".[bench]\")")


def write_chart(path: Path, results: Sequence[Result], title: str) -> bool:
    """A grouped bar chart of speedup over eager; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys(f"{r.workload}\n{r.mode}" for r in results if r.backend != "-"))
    backends = list(dict.fromkeys(r.backend for r in results if r.backend != "-"))
    if not groups or not backends:
        return False
    speedups = {(f"{r.workload}\n{r.mode}", r.backend): r.speedup for r in results}
    width = 0.8 / len(backends)
    figure, axis = plt.subplots(figsize=(max(8, 0.9 * len(groups) * max(1, len(backends) / 2)), 4.5))
    for index, backend in enumerate(backends):
        heights = [speedups.get((group, backend)) or 0.0 for group in groups]
        positions = [g + (index - (len(backends) - 1) / 2) * width for g in range(len(groups))]
        axis.bar(positions, heights, width, label=backend)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(groups)), groups, fontsize=7)
    axis.set_ylabel("speedup over eager (0: failed, wrong or skipped)")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
