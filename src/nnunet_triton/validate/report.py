"""The validation report: ``validation.json``, ``validation.md`` and a self-contained ``validation.html``.

The HTML page holds a summary table, per case and label the Dice, the voxel counts and the volume
difference, and for each case that disagrees a picture of the slice with the most differing voxels
(image, nnU-Net, endpoint, difference), plus a plot of per-label Dice across cases. Pictures are PNGs
drawn with matplotlib (Agg backend, imported only here) and embedded as data URIs, so the page is one
file that opens anywhere. Every file is written atomically (``imageio.atomic_output``); an interrupted
run's report says so at the top.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from nnunet_triton.client.imageio import atomic_output
from nnunet_triton.validate.run import CaseResult, ValidationResult

__all__ = ["write_report", "markdown", "html_page"]


def _verdict(result: ValidationResult) -> str:
    if result.interrupted:
        return f"INTERRUPTED after {len(result.cases)} of {result.total} cases (partial report)"
    failed = sum(not c.passed for c in result.cases)
    return "PASS" if result.passed else f"FAIL ({failed} of {len(result.cases)} cases)"


def _criterion(result: ValidationResult) -> str:
    t = result.thresholds
    if t.exact:
        return "exact: every voxel equal" + (f", probabilities within {t.probability_tolerance:g}"
                                             if result.options.probabilities else "")
    return f"Dice >= {t.min_dice:g} for every label"


def _rows(case: CaseResult) -> list[list[str]]:
    if case.comparison is None:
        return [[case.case, "ERROR", "", "", "", "", case.error or ""]]
    c = case.comparison
    rows = []
    for label in c.labels or ():
        rows.append([case.case, "pass" if case.passed else "FAIL", f"{label.name} ({label.value})",
                     f"{label.dice:.6f}", f"{label.reference_voxels} / {label.endpoint_voxels}",
                     f"{label.volume_difference_ml:+.3f}", f"agreement {c.agreement:.6f}"
                     + (f", max prob. diff {c.max_probability_difference:.2e}"
                        if c.max_probability_difference is not None else "")])
    return rows or [[case.case, "pass" if case.passed else "FAIL", "(no labels)", "1.000000", "0 / 0",
                     "+0.000", f"agreement {c.agreement:.6f}"]]


HEADER = ["case", "verdict", "label", "Dice", "voxels nnU-Net / endpoint", "volume diff (ml)", "notes"]


def markdown(result: ValidationResult) -> str:
    lines = [f"# {result.title}", "", f"**{_verdict(result)}** - {_criterion(result)}", "",
             f"- reference: {result.reference_kind}",
             f"- options: {json.dumps(result.options.to_dict(), sort_keys=True)}",
             f"- deployment: {json.dumps({k: result.deployment.get(k) for k in sorted(result.deployment)})}",
             "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for case in result.cases:
        lines.extend("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in _rows(case))
    return "\n".join(lines) + "\n"


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _case_picture(case: CaseResult) -> str | None:
    if not case.picture:
        return None
    from matplotlib.figure import Figure

    p = case.picture
    figure = Figure(figsize=(12, 3.4))
    axes = figure.subplots(1, 4)
    vmax = max(int(p["reference"].max()), int(p["endpoint"].max()), 1)
    panels = [("image", p["image"], "gray", None), ("nnU-Net", p["reference"], "viridis", vmax),
              ("endpoint", p["endpoint"], "viridis", vmax),
              ("difference", (p["reference"] != p["endpoint"]).astype(np.uint8), "Reds", 1)]
    for ax, (title, data, cmap, top) in zip(axes, panels, strict=True):
        ax.imshow(data, cmap=cmap, vmin=0 if top else None, vmax=top, interpolation="nearest")
        ax.set_title(title)
        ax.axis("off")
    figure.suptitle(f"{case.case}: slice {case.comparison.worst_slice} (most differing voxels)")
    return _png(figure)


def _dice_plot(result: ValidationResult) -> str | None:
    compared = [c for c in result.cases if c.comparison is not None and c.comparison.labels]
    if not compared:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(max(5, 0.6 * len(compared) + 3), 3.5))
    ax = figure.subplots()
    names = sorted({(lab.value, lab.name) for c in compared for lab in c.comparison.labels})
    for value, name in names:
        dice = [next((lab.dice for lab in c.comparison.labels if lab.value == value), np.nan)
                for c in compared]
        ax.plot(range(len(compared)), dice, marker="o", label=f"{name} ({value})")
    ax.axhline(result.thresholds.min_dice, color="red", linestyle="--", linewidth=1, label="threshold")
    ax.set_xticks(range(len(compared)), [c.case for c in compared], rotation=45, ha="right")
    ax.set_ylabel("Dice")
    ax.set_title("Dice per label across cases")
    ax.legend(fontsize="small")
    return _png(figure)


def html_page(result: ValidationResult) -> str:
    e = html.escape
    ok = result.passed
    parts = [
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>{e(result.title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}.pass{color:#070}.fail{color:#b00}</style></head><body>",
        f"<h1>{e(result.title)}</h1>",
        f"<p id='verdict' class='{'pass' if ok else 'fail'}'><b>{e(_verdict(result))}</b> - "
        f"{e(_criterion(result))}</p>",
        f"<p>reference: {e(result.reference_kind)}<br>options: "
        f"{e(json.dumps(result.options.to_dict(), sort_keys=True))}</p>",
        "<table id='summary'><tr>" + "".join(f"<th>{e(h)}</th>" for h in HEADER) + "</tr>",
    ]
    for case in result.cases:
        for row in _rows(case):
            css = "pass" if case.passed else "fail"
            parts.append(f"<tr class='{css}'>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>")
    parts.append("</table>")
    plot = _dice_plot(result)
    if plot:
        parts.append(f"<h2>Dice across cases</h2><img class='dice-plot' alt='Dice per label' src='{plot}'>")
    pictures = [(c, _case_picture(c)) for c in result.cases if c.picture]
    if pictures:
        parts.append("<h2>Where they differ</h2>")
        for case, picture in pictures:
            parts.append(f"<figure><img class='case-picture' alt='{e(case.case)}' src='{picture}'>"
                         f"<figcaption>{e(case.case)}: {case.comparison.differing_voxels} differing voxels"
                         "</figcaption></figure>")
    # the page counts its decoded pictures (checked in a headless browser by the tests)
    parts.append("<script>window.addEventListener('load', () => document.body.setAttribute("
                 "'data-images-loaded', [...document.images].filter(i => i.complete && i.naturalWidth > 0)"
                 ".length));</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(result: ValidationResult, folder: str | Path) -> dict[str, Path]:
    """Write the three files into ``folder`` (created) and return their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in (("validation.json", json.dumps(result.to_dict(), indent=2) + "\n"),
                       ("validation.md", markdown(result)), ("validation.html", html_page(result))):
        with atomic_output(folder / name) as partial:
            partial.write_text(text)
        written[name] = folder / name
    return written
