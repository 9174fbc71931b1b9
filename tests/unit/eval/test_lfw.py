"""LFW protocol helpers: pairs parsing, thresholds, 10-fold evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from facegate.errors import InvalidParameterError
from facegate.eval.lfw import (
    Pair,
    best_threshold,
    evaluate_scores,
    pair_images,
    read_pairs,
    threshold_at_fmr,
)


def test_read_pairs_small(tmp_path: Path) -> None:
    (tmp_path / "pairs.txt").write_text("2 1\nA 1 2\nA 1 B 3\nC 2 4\nC 1 D 1\n")
    pairs = read_pairs(tmp_path)
    assert [p.fold for p in pairs] == [0, 0, 1, 1]
    assert [p.same for p in pairs] == [True, False, True, False]
    assert pairs[1].b == "B/B_0003.jpg"
    assert pair_images(pairs)[:3] == ["A/A_0001.jpg", "A/A_0002.jpg", "B/B_0003.jpg"]
    (tmp_path / "pairs.txt").write_text("2 1\nA 1 2\n")
    with pytest.raises(InvalidParameterError):
        read_pairs(tmp_path)
    for text in ("1 1\nA 1 2\nA 1 B 3\n", "2 0\n"):  # one fold has no others to pick its threshold; no pairs
        (tmp_path / "pairs.txt").write_text(text)
        with pytest.raises(InvalidParameterError, match="line 1"):
            read_pairs(tmp_path)


def test_real_pairs_are_identity_disjoint(lfw_root: Path) -> None:
    pairs = read_pairs(lfw_root)
    assert len(pairs) == 6000 and sum(p.same for p in pairs) == 3000
    people: dict[int, set[str]] = {}
    for p in pairs:
        people.setdefault(p.fold, set()).update({p.a.split("/")[0], p.b.split("/")[0]})
    folds = list(people.values())
    assert all(not (folds[i] & folds[j]) for i in range(10) for j in range(i + 1, 10))
    assert len(pair_images(pairs)) == 7701


def test_best_threshold_separable() -> None:
    s = np.array([0.1, 0.2, 0.3, 0.7, 0.8, 0.9])
    y = np.array([0, 0, 0, 1, 1, 1], bool)
    t = best_threshold(s, y)
    assert 0.3 < t < 0.7 and np.all((s >= t) == y)


def test_threshold_at_fmr() -> None:
    imp = np.linspace(0, 1, 1001)  # 1001 impostors
    t = threshold_at_fmr(imp, 0.01)
    assert np.mean(imp >= t) <= 0.01
    assert np.mean(imp >= np.nextafter(t, -np.inf) - 1e-3) > 0.01  # not needlessly high


def test_evaluate_scores_folds() -> None:
    rng = np.random.default_rng(0)
    n = 600
    labels = np.arange(n) % 2 == 0
    scores = np.where(labels, rng.normal(0.7, 0.1, n), rng.normal(0.1, 0.1, n))
    folds = np.arange(n) // 60
    pairs = [Pair("a", "b", int(f), bool(y)) for f, y in zip(folds, labels, strict=True)]
    res = evaluate_scores(scores, pairs, fmr=1e-2)
    assert len(res["fold_accuracies"]) == 10 and res["accuracy_mean"] > 0.98
    assert 0.0 <= res["tar_at_fmr"] <= 1.0 and res["fmr"] == 1e-2
    assert np.mean(scores[~labels] >= res["threshold_at_fmr"]) <= 1e-2
