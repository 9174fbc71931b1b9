"""benchmarks/pose_mesh.py's geometry: the symmetric mean face, the mesh yaw label and the rendered turn."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from pose_mesh import build_template, lift, mesh_yaw, render_turn, turn_mesh

N = 9  # grid side (odd: a midline column)


def face_grid(scale: float = 12.0, centre: tuple[float, float] = (64.0, 64.0)) -> tuple[np.ndarray, np.ndarray]:
    """A frontal, left-right symmetric ``(N*N, 3)`` face-like surface in pixels (a rounded head with a nose bump,
    smaller z nearer) and its ``(T, 3)`` grid triangles."""
    u = np.linspace(-1.0, 1.0, N)
    x, y = np.meshgrid(u, u)
    z = 0.8 * (x**2 + 0.3 * y**2) - 0.9 * np.exp(-(x**2 + (y - 0.1) ** 2) / 0.08)
    pts = np.stack([centre[0] + scale * 2 * x, centre[1] + scale * 2 * y, scale * 2 * z], axis=-1).reshape(-1, 3)
    i = np.arange(N * N).reshape(N, N)
    a, b, c, d = i[:-1, :-1].ravel(), i[:-1, 1:].ravel(), i[1:, :-1].ravel(), i[1:, 1:].ravel()
    return pts, np.concatenate([np.stack([a, b, d], 1), np.stack([a, d, c], 1)])


def rotate(pts: np.ndarray, yaw: float, roll: float = 0.0) -> np.ndarray:
    """``pts`` turned by ``yaw`` degrees about the vertical axis through its centroid, then rolled in the image."""
    c = pts.mean(axis=0)
    t, r = math.radians(yaw), math.radians(roll)
    ry = np.array([[math.cos(t), 0, -math.sin(t)], [0, 1, 0], [math.sin(t), 0, math.cos(t)]])
    rz = np.array([[math.cos(r), -math.sin(r), 0], [math.sin(r), math.cos(r), 0], [0, 0, 1]])
    return (pts - c) @ (rz @ ry).T + c


def test_template_is_symmetric_and_reads_known_yaws() -> None:
    face, _ = face_grid()
    rng = np.random.default_rng(0)
    yaws = rng.uniform(-30, 30, 40)
    meshes = np.stack([rotate(face + rng.normal(0, 0.05, face.shape), y, rng.uniform(-5, 5)) for y in yaws])
    template, lateral, mirror = build_template(meshes)
    cols = np.arange(N * N) % N
    assert np.array_equal(mirror, np.arange(N * N) - cols + (N - 1 - cols))  # each column maps to its mirror column
    assert abs(lateral[0]) > 0.99
    for y in (-70.0, -45.0, -10.0, 0.0, 25.0, 60.0):
        for roll in (0.0, 12.0):
            assert mesh_yaw(rotate(face, y, roll), template, lateral) == pytest.approx(y, abs=0.5)


def test_turn_mesh_adds_its_turn_to_the_yaw_label() -> None:
    face, _ = face_grid()
    template, lateral, _ = build_template(np.stack([rotate(face, y) for y in (-8.0, -3.0, 0.0, 4.0, 7.0)]))
    start = rotate(face, 10.0)
    for deg in (-40.0, 15.0, 45.0):
        got = mesh_yaw(turn_mesh(start, deg), template, lateral)
        assert got == pytest.approx(10.0 + deg, abs=0.5)


def test_render_moves_the_texture_with_the_mesh() -> None:
    face, tris = face_grid()
    img = np.full((128, 128, 3), 90, np.uint8)
    nose = int(np.argmin(face[:, 2]))  # the nearest vertex: the nose tip, at the grid's centre
    x0, y0 = np.round(face[nose, :2]).astype(int)
    img[y0 - 1 : y0 + 2, x0 - 1 : x0 + 2] = (255, 0, 0)  # a red mark on the nose tip
    same = render_turn(img, face, tris, 0.0)
    assert np.array_equal(same[y0 - 1 : y0 + 2, x0 - 1 : x0 + 2], img[y0 - 1 : y0 + 2, x0 - 1 : x0 + 2])
    turned = render_turn(img, face, tris, 30.0)
    red = np.argwhere((turned[..., 0] > 200) & (turned[..., 1] < 60))
    want = turn_mesh(face, 30.0)[nose, :2]
    assert red.size and np.abs(red[:, ::-1].mean(axis=0) - want).max() < 1.5  # the mark went where the nose went
    assert want[0] - face[nose, 0] > 5  # and that is well away from where it was
    assert not ((turned[y0 - 1 : y0 + 2, x0 - 1 : x0 + 2, 0] > 200).any())


def test_lift_follows_the_surface() -> None:
    face, tris = face_grid()
    pts = face[[10, 40, 50], :2] * 0.5 + face[[11, 41, 59], :2] * 0.5  # midpoints of mesh edges
    idx, w = lift(pts, face, tris)
    assert np.allclose((face[idx, :2] * w[:, :, None]).sum(axis=1), pts, atol=1e-6)
    turned = turn_mesh(face, 20.0)
    want = turn_mesh(face, 20.0)[[10, 40, 50]] * 0.5 + turned[[11, 41, 59]] * 0.5
    assert np.allclose((turned[idx, :2] * w[:, :, None]).sum(axis=1), want[:, :2], atol=1e-6)
