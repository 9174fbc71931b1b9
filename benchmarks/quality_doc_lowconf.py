"""The ``low_confidence`` section of docs/quality.md, from ``benchmarks/quality_lowconf.py``'s JSON (every number in
it comes from that file)."""

from __future__ import annotations

from typing import Any

SIGNAL = {
    "det_score": "detector score `sqrt(cls · obj)` (shipped input)",
    "cls": "class probability alone",
    "obj": "objectness alone",
    "lm_residual": "landmark fit residual, crop px",
    "out_of_box": "face region outside the box",
    "out_of_photo": "face region outside the photo",
    "box_out_of_photo": "unclipped box outside the photo",
}
FAMILY = {
    "grain": "grain ≥ 3",
    "cut": "frame cut ≥ 3",
    "jpeg": "JPEG ≥ 3",
    "any": "any of the three",
}


def pct(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{100 * v:.{nd}f} %"


def meets(h: dict[str, Any]) -> bool:
    return h["precision"] >= 0.9 and h["recall"] >= 0.8


def pr(h: dict[str, Any], sep: str = " | ") -> str:
    """``precision | recall | clean firing`` cells (or one cell, with ``sep`` " / "), recall marked ✗ when the
    target is missed."""
    mark = "" if meets(h) else " ✗"
    return sep.join((f"{h['precision']:.3f}", f"{h['recall']:.3f}{mark}", pct(h["clean_fire_rate"], 2)))


#: the signal shipped (the detector's score stays at the detector's own threshold, where it never fires), the pair
#: that would add the score, and the stratum whose limits set them
SHIPPED_SIGNAL, SCORE_PAIR, SHIPPED_STRATUM = "out_of_photo", "det_score+out_of_photo", "cut"


def lowconf_reason_row(x: dict[str, Any]) -> str:
    """The ``low_confidence`` row of the reasons' precision and recall table (held out, the shipped rule's stratum)."""
    h, s = x["single"][SHIPPED_STRATUM][SHIPPED_SIGNAL], x["shipped_settings"]
    return (
        f"| `low_confidence` | face partly out of the frame ({x['env']['config']['photos']} photos, "
        f"[below](#low-confidence-which-signal-says-the-detector-is-unsure)) | {h['limits_all_folds'][0]:.3f} "
        f"(`max_outside_photo` = {s['max_outside_photo']:g}; `min_det_score` = {s['min_det_score']:g}) | "
        f"{h['precision']:.3f} | {h['recall']:.3f}{'' if meets(h) else ' ✗'} | "
        f"{pct(h['clean_fire_rate'], 2)} | {h['positives']} |"
    )


def lowconf_real_row(x: dict[str, Any]) -> str:
    """The ``low_confidence`` row of the real-stratum table (clean faces of pairs.txt's genuine pairs)."""
    rs = x["real_stratum"]
    return (
        "| `low_confidence` (a face fails when its clean-against-clean pair does, "
        "[below](#low-confidence-which-signal-says-the-detector-is-unsure)) | "
        f"{rs['compared_faces']} | {rs['fires']} | {pct(rs['failing_among_fired'])} | "
        f"{pct(rs['failing_overall'])} |"
    )


def lowconf_section(x: dict[str, Any]) -> list[str]:
    """Markdown lines of the section."""
    vs, s = x["variants"], x["shipped_settings"]
    lim = x["single"][SHIPPED_STRATUM][SHIPPED_SIGNAL]["limits_all_folds"]
    pair = x["pairs"][SHIPPED_STRATUM][SCORE_PAIR]
    fams = list(x["single"])
    cfg = x["env"]["config"]
    L = [
        "",
        "### Low confidence: which signal says the detector is unsure",
        "",
        f"All {cfg['clean_photos']:,} pairs.txt photos go through the CPU pipeline as served (largest face): the "
        f"negatives, the real stratum and the guardrail. {cfg['photos']} of them also go through degraded in three "
        "ways that make a face harder to find, each at severity 1-5: sensor-like grain (σ 6, 12, 20, 32, 48 grey "
        "levels), the face partly out of the frame (`cut`: 10, 20, 30, 40, 50 % of its box's width cut off, on a "
        "random side) and heavy JPEG compression (quality 40, 20, 12, 7, 3). Positives: a family's faces at "
        "severity ≥ 3, found (a face not found is a failure to acquire, not a positive). Command: "
        f"`{x['collected']['command']}` ({cfg['seconds']:.0f} s on the CPU).",
        "",
        "Signals, per face:",
        "",
        "- the detector's score as shipped, `sqrt(cls · obj)` of the kept anchor (OpenCV's rule for YuNet), and its "
        "class probability and objectness apart;",
        "- the landmark fit residual: the RMS distance, in 112×112 crop pixels, of the 5 landmarks from the ArcFace "
        "template after the similarity (Umeyama) fit that alignment makes;",
        "- the share of the face region the landmarks imply (the aligned crop's brows-to-chin, cheek-to-cheek "
        "region, mapped back to the photo) that lies outside the detected box, which the detector clips to the "
        "photo; the same region's share outside the photo (a detection carries its photo's size); and the share "
        "of the box as the network predicted it, before clipping, outside the photo.",
        "",
        "| variant | found | score | cls | obj | residual | outside box | outside photo | `low_confidence` fires |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in vs.items():
        L.append(
            f"| {name} | {pct(v['found'])} | {v['det_score_median']:.3f} | {v['cls_median']:.3f} | "
            f"{v['obj_median']:.4f} | {v['lm_residual_median']:.2f} | {pct(v['out_of_box_median'])} | "
            f"{pct(v['out_of_photo_median'])} | "
            f"{pct(v['shipped_fires'])} |"
        )
    L += [
        "",
        "Medians of the found faces; the last column is the shipped rule.",
        "",
        "Each limit is chosen on nine identity folds and measured on the tenth, as for the other reasons (at most "
        "0.2 % of the training folds' clean faces, the most lenient limit finding 85 % of their positives, else "
        'the best recall); two signals together ("either fires") get a limit each by the same rule within half '
        "that budget. Precision / recall / clean faces firing, pooled over the held-out folds (positives in "
        "brackets):",
        "",
        "| signal | " + " | ".join(f"{FAMILY[f]} ({x['single'][f]['det_score']['positives']})" for f in fams) + " |",
        "|---|" + "---|" * len(fams),
    ]
    for k in x["single"][fams[0]]:
        L.append(f"| {SIGNAL[k]} | " + " | ".join(pr(x["single"][f][k], " / ") for f in fams) + " |")
    for k in x["pairs"][fams[0]]:
        a, b = k.split("+")
        L.append(f"| {SIGNAL[a]} or {SIGNAL[b]} | " + " | ".join(pr(x["pairs"][f][k], " / ") for f in fams) + " |")
    L += [
        "",
        "✗: below precision 0.9 at recall 0.8. Clean quantiles (0.2 %, 50 %, 99.8 %): "
        + "; ".join(
            f"{SIGNAL[k]} {q['0.002']:.3g}, {q['0.5']:.3g}, {q['0.998']:.3g}"
            for k, q in x["clean_quantiles"].items()
            if k in ("det_score", "cls", "obj", "lm_residual", "out_of_box")
        )
        + ".",
        "",
        "**Shipped rule.** `low_confidence` fires when more than `max_outside_photo` "
        f"({s['max_outside_photo']:g}, the limit the rule chooses on all folds of the frame-cut stratum, "
        f'{lim[0]:.4f}) of the face region lies outside the photo ("face partly outside the photo (…): show the '
        'whole face"), else when the detector score is below `min_det_score` ("face hard to find (…): show the '
        f"whole face, in focus\"), which stays at the detector's own threshold ({s['min_det_score']:g}), where it "
        "never fires. With the score as a second signal the pair rule would choose "
        f"{pair['limits_all_folds'][0]:.3f} for it; held out on frame cut ≥ 3 that pair gives "
        f"{pr(pair, ' / ')}, and on grain and JPEG it finds no more than a third of the faces (table above). "
        "LFW's press photos cannot set a confidence limit for other cameras, and the refusals it would add are "
        "of faces the detector still finds, so the setting is left to a deployment that measures its own. A "
        "detection carries its photo's size for this (an aligned-crop upload has none, and no detector score). "
        "As served:",
        "",
        "| stratum | positives | precision | recall | clean faces firing |",
        "|---|---|---|---|---|",
    ]
    for f in fams:
        h = x["shipped"][f]
        L.append(f"| {FAMILY[f]} | {h['positives']} | {pr(h)} |")
    rs, c, cq = x["real_stratum"], x["clean_refusal"], x["clean_quantiles"]
    met = [FAMILY[f] for f in fams if f != "any" and meets(x["single"][f][SHIPPED_SIGNAL])]
    best = {
        f: max([*x["single"][f].values(), *x["pairs"][f].values()], key=lambda h: h["recall"])
        for f in fams
        if f not in ("any", SHIPPED_STRATUM)
    }
    L += [
        "",
        f"Held out, the shipped signal meets precision ≥ 0.9 at recall ≥ 0.8 on {', '.join(met) or 'no stratum'}. "
        + " ".join(
            f"On {FAMILY[f]} no signal does: the best, {' or '.join(SIGNAL[k] for k in h['signals'])}, finds "
            f"{h['recall']:.3f} (precision {h['precision']:.3f})."
            for f, h in best.items()
        )
        + " Grain and JPEG lower the detector's confidence below the clean faces' 0.2 % quantile "
        f"({cq['det_score']['0.002']:.3f}) only at the severities where it also stops finding faces (the `found` "
        "column), so most faces it still returns score like clean ones. The landmark residual rises only on the "
        f"most cut faces (median {vs['cut5']['lm_residual_median']:.2f} crop px at cut5, clean "
        f"{cq['lm_residual']['0.5']:.2f}), inside the clean faces' own spread (99.8 % quantile "
        f"{cq['lm_residual']['0.998']:.2f}): the detector's landmarks keep a face's shape even where it "
        "extrapolates them. The face region outside the clipped box grows with a turned head's far cheek (clean "
        "faces, median by landmark yaw: "
        + ", ".join(f"{b['yaw']}° {pct(b['median'])}" for b in x["clean_out_of_box_by_yaw"] if b["faces"])
        + f"; 99.8 % quantile {pct(cq['out_of_box']['0.998'])}), so on the clean side it cannot tell a cut face "
        "from a turned one. The frame-cut label and the shipped signal describe one fact from two "
        "sides: the "
        "label is the share of the clean face's box the cut removed, the signal the share of the face region that "
        "the detector's landmarks of the cut photo place past the frame. LFW's faces sit in the middle of their "
        "250×250 photos, so its clean faces never test a tight crop, where a face's cheeks or chin touch the frame.",
    ]
    L += [
        "",
        f"Real stratum (clean faces of pairs.txt's genuine pairs; a face fails when its clean comparison misses the "
        f"match threshold {rs['match_threshold']:.4f}): `low_confidence` fires on {rs['fires']} of "
        f"{rs['compared_faces']:,} faces; {pct(rs['failing_among_fired'])} of those fail, against "
        f"{pct(rs['failing_overall'])} overall. **Clean faces refused at the verify gate** "
        f"({x['verify_gate']:.2f}, the shipped limits, all reasons; {c['clean_faces']:,} clean faces found, "
        f"{c['not_found']} not): {pct(c['refused'], 2)} (guardrail ≤ 0.5 %); `low_confidence` fires on "
        f"{pct(c['low_confidence_fires'], 2)} of them, the other reasons and the gate refuse "
        f"{pct(c['other_reasons_or_gate'], 2)}.",
    ]
    return L
