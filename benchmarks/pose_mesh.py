"""A 3D face mesh for the pose benchmark: real-pose labels and a rendered head turn of LFW's photos.

mediapipe's FaceMesh (the legacy ``mp.solutions.face_mesh`` of the ``mediapipe==0.10.14`` wheel, whose model ships
inside it) gives each photo 468 landmarks in 3D (x, y in pixels, z depth in x's scale, smaller nearer). mediapipe is a
benchmark-only tool, never a facegate dependency: this step runs in its own virtualenv and writes an ``.npz`` that
``benchmarks/quality_pose_mesh.py`` reads in the project's. The geometry below needs only numpy and OpenCV, so both
steps render the same turns.

- **Yaw label.** A symmetric mean face is built from the photos' own meshes (generalised Procrustes, then the
  mirror pairing that best maps the mean face onto its reflection); each mesh's yaw is the rotation that best aligns
  that face with it (Kabsch), read as the angle of the face's left-right axis out of the image plane.
- **Rendered turn.** The mesh is rotated about a vertical axis through its midline at the depth of its deepest vertex
  (the sides of the face, by the ears), projected orthographically, and each of its triangles (mediapipe's
  tessellation) is warped from the photo to its turned place, nearest last; the photo's original face is first
  filled in from around it (OpenCV's inpainting), so that what the turn uncovers is skin and hair tones, not the
  original features.
- **Check.** Every rendered turn goes through FaceMesh again: its yaw label should move by the turn.

    /work/venv-mp/bin/python benchmarks/pose_mesh.py --out out/pose_mesh.npz
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import cv2
import numpy as np

log = logging.getLogger("pose_mesh")
ANGLES = (0, 15, 30, 45, 60, 75)


def pairs_photos(lfw: Path) -> list[str]:
    """pairs.txt's photos (``person/file.jpg``), sorted: the list ``benchmarks/common.py`` samples from."""
    rows = [ln.split() for ln in (lfw / "pairs.txt").read_text().strip().splitlines()[1:]]
    out = set()
    for r in rows:
        a, b = ((r[0], r[1]), (r[0], r[2])) if len(r) == 3 else ((r[0], r[1]), (r[2], r[3]))
        out |= {f"{n}/{n}_{int(i):04d}.jpg" for n, i in (a, b)}
    return sorted(out)


def sample(every: list[str], n: int) -> list[str]:
    """``n`` photos evenly spaced over ``every`` (as ``common.pair_photo_sample``)."""
    return every[:: max(1, len(every) // n)][:n]


def turn_side(path: str) -> int:
    """+1 or -1: the side a photo is turned to, fixed by its path."""
    return 1 if zlib.crc32(path.encode()) % 2 else -1


def kabsch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(3, 3)`` proper rotation ``R`` minimising ``|R a_i - b_i|`` over centred ``(N, 3)`` point sets."""
    u, _, vt = np.linalg.svd(b.T @ a)
    d = np.sign(np.linalg.det(u @ vt))
    return u @ np.diag([1.0, 1.0, d]) @ vt


def normalise(m: np.ndarray) -> np.ndarray:
    """``(N, 3)`` points centred and scaled to unit RMS radius."""
    c = m - m.mean(axis=0)
    return c / np.sqrt((c**2).sum(axis=1).mean())


def build_template(meshes: np.ndarray, iters: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A symmetric mean face of ``(K, 468, 3)`` meshes: ``(template (468, 3), lateral (3,), mirror (468,) int)``.

    Generalised Procrustes gives the mean shape, turned to the meshes' mean orientation; the mirror pairing maps each
    vertex to its reflection's nearest vertex (iterated with a rigid fit, from the reflection about x); the template
    is the mean of the shape and its relabelled reflection, and ``lateral`` the unit normal of its symmetry plane
    (pointing to the image's +x on a frontal face)."""
    ms = np.stack([normalise(m) for m in meshes])
    ref = ms[0]
    for _ in range(iters):
        ref = normalise(np.mean([kabsch(m, ref) @ m.T for m in ms], axis=0).T)
    # back to the meshes' mean orientation (LFW's faces are frontal on average)
    rot = sum(kabsch(ref, m) for m in ms)
    u, _, vt = np.linalg.svd(rot)
    ref = ref @ (u @ vt).T
    flip = ref * np.array([-1.0, 1.0, 1.0])
    r = np.eye(3)
    for _ in range(20):
        moved = flip @ r.T
        mirror = np.argmin(((moved[:, None] - ref[None]) ** 2).sum(axis=2), axis=1)
        r = kabsch(flip, ref[mirror])
    refl = r @ np.diag([-1.0, 1.0, 1.0])  # the improper map that takes the face onto itself
    w, v = np.linalg.eigh((refl + refl.T) / 2)
    lateral = v[:, int(np.argmin(w))]
    lateral = lateral if lateral[0] > 0 else -lateral
    inv = np.argsort(mirror)
    template = (ref + (ref @ refl.T)[inv]) / 2 if np.array_equal(np.sort(mirror), np.arange(len(ref))) else ref
    return normalise(template), lateral, mirror


def mesh_yaw(mesh: np.ndarray, template: np.ndarray, lateral: np.ndarray) -> float:
    """Yaw in degrees of a ``(468, 3)`` mesh (pixels): the template's rigid fit to it (Kabsch), read as the angle of
    its left-right axis out of the image plane; positive when the face's +x side turns away (z grows)."""
    r = kabsch(template, normalise(mesh))
    lx, ly, lz = r @ lateral
    return math.degrees(math.atan2(lz, math.hypot(lx, ly)))


def turn_mesh(mesh: np.ndarray, deg: float) -> np.ndarray:
    """``(468, 3)`` mesh turned by ``deg`` about a vertical axis through its midline (mean x) at the depth of its
    deepest vertex: ``x' = xc + (x - xc) cos θ - (z - zc) sin θ``, ``z' = zc + (x - xc) sin θ + (z - zc) cos θ``."""
    th = math.radians(deg)
    xc, zc = float(mesh[:, 0].mean()), float(mesh[:, 2].max())
    out = mesh.copy()
    out[:, 0] = xc + (mesh[:, 0] - xc) * math.cos(th) - (mesh[:, 2] - zc) * math.sin(th)
    out[:, 2] = zc + (mesh[:, 0] - xc) * math.sin(th) + (mesh[:, 2] - zc) * math.cos(th)
    return out


def lift(points: np.ndarray, mesh: np.ndarray, tris: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mesh surface under ``(K, 2)`` image points (the nearest layer where the mesh overlaps itself): per point
    its triangle's vertex indices ``(K, 3) int`` and barycentric weights ``(K, 3) float64``, so that the point
    follows the mesh through :func:`turn_mesh`. ``mesh`` ``(468, 3)``, ``tris`` ``(T, 3) int``; a point off the mesh
    takes its nearest vertex."""
    a, b, c = (mesh[tris[:, i], :2] for i in range(3))
    v0, v1 = b - a, c - a
    den = v0[:, 0] * v1[:, 1] - v0[:, 1] * v1[:, 0]
    den = np.where(np.abs(den) < 1e-9, 1e-9, den)
    idx = np.zeros((len(points), 3), np.int64)
    wts = np.zeros((len(points), 3))
    for k, p in enumerate(points):
        d = p - a
        s = (d[:, 0] * v1[:, 1] - d[:, 1] * v1[:, 0]) / den
        t = (v0[:, 0] * d[:, 1] - v0[:, 1] * d[:, 0]) / den
        inside = np.flatnonzero((s >= -1e-6) & (t >= -1e-6) & (s + t <= 1 + 1e-6))
        if inside.size:
            bw = np.stack([1 - s[inside] - t[inside], s[inside], t[inside]], axis=1)
            z = (bw * mesh[tris[inside], 2]).sum(axis=1)
            j = int(np.argmin(z))
            idx[k], wts[k] = tris[inside[j]], bw[j]
        else:
            idx[k] = int(np.argmin(((mesh[:, :2] - p) ** 2).sum(axis=1)))
            wts[k] = (1.0, 0.0, 0.0)
    return idx, wts


def render_turn(img: np.ndarray, mesh: np.ndarray, tris: np.ndarray, deg: float) -> np.ndarray:
    """``(H, W, 3) uint8`` photo with the face of ``mesh`` ``(468, 3)`` (pixels) turned by ``deg`` degrees
    (:func:`turn_mesh`); ``tris`` ``(T, 3) int``: the mesh's triangles. Orthographic; triangles facing away are left
    out, the rest drawn far to near; outside the turned face the photo, with its original face inpainted."""
    h, w = img.shape[:2]
    dst = turn_mesh(mesh, deg)
    hull = cv2.convexHull(np.round(mesh[:, :2]).astype(np.int32))
    mask = np.zeros((h, w), np.uint8)
    cv2.fillConvexPoly(mask, hull, 255)
    mask = cv2.dilate(mask, np.ones((5, 5), np.uint8))
    out = cv2.inpaint(img, mask, 5, cv2.INPAINT_TELEA)

    def area(p: np.ndarray) -> np.ndarray:
        a, b, c = p[tris[:, 0], :2], p[tris[:, 1], :2], p[tris[:, 2], :2]
        return (b[:, 0] - a[:, 0]) * (c[:, 1] - a[:, 1]) - (b[:, 1] - a[:, 1]) * (c[:, 0] - a[:, 0])

    a_src, a_dst = area(mesh), area(dst)
    keep = np.flatnonzero((np.sign(a_src) == np.sign(a_dst)) & (np.abs(a_dst) > 1e-3) & (np.abs(a_src) > 1e-3))
    keep = keep[np.argsort(-dst[tris[keep], 2].mean(axis=1))]  # far first, near last
    ids = np.full((h, w), -1, np.int32)
    for t in keep:
        cv2.fillConvexPoly(ids, np.round(dst[tris[t], :2] * 16).astype(np.int32), int(t), cv2.LINE_8, 4)
    ys, xs = np.nonzero(ids >= 0)
    if xs.size == 0:
        return out
    t = ids[ys, xs]
    # each target pixel's barycentric weights in its turned triangle, applied to the source triangle
    a, b, c = (dst[tris[t, i], :2] for i in range(3))
    v0, v1, d = b - a, c - a, np.stack([xs, ys], axis=1) - a
    den = v0[:, 0] * v1[:, 1] - v0[:, 1] * v1[:, 0]
    s = (d[:, 0] * v1[:, 1] - d[:, 1] * v1[:, 0]) / den
    u = (v0[:, 0] * d[:, 1] - v0[:, 1] * d[:, 0]) / den
    sa, sb, sc = (mesh[tris[t, i], :2] for i in range(3))
    src = sa + s[:, None] * (sb - sa) + u[:, None] * (sc - sa)
    mx = np.zeros((h, w), np.float32)
    my = np.zeros((h, w), np.float32)
    mx[ys, xs], my[ys, xs] = src[:, 0], src[:, 1]
    warped = cv2.remap(img, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
    out[ys, xs] = warped[ys, xs]
    return out


def tessellation() -> np.ndarray:
    """``(T, 3) int`` triangles of mediapipe's face mesh: the 3-cliques of its tessellation's edges."""
    import mediapipe as mp

    edges = {frozenset(e) for e in mp.solutions.face_mesh_connections.FACEMESH_TESSELATION}
    nb: dict[int, set[int]] = {}
    for e in edges:
        i, j = tuple(e)
        nb.setdefault(i, set()).add(j)
        nb.setdefault(j, set()).add(i)
    tris = {frozenset((*tuple(e), k)) for e in edges for k in nb[min(e)] & nb[max(e)]}
    return np.asarray(sorted(sorted(t) for t in tris), np.int64)


class Mesher:
    """FaceMesh on one photo at a time (static images, the face nearest the photo's centre)."""

    def __init__(self) -> None:
        import mediapipe as mp

        self.fm = mp.solutions.face_mesh.FaceMesh(
            static_image_mode=True, max_num_faces=3, refine_landmarks=False, min_detection_confidence=0.3
        )

    def __call__(self, bgr: np.ndarray) -> np.ndarray | None:
        """``(468, 3) float64`` mesh (x, y, z in pixels) of a ``(H, W, 3) uint8`` BGR photo, or None."""
        h, w = bgr.shape[:2]
        res = self.fm.process(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        if not res.multi_face_landmarks:
            return None
        ms = [np.array([[p.x * w, p.y * h, p.z * w] for p in f.landmark]) for f in res.multi_face_landmarks]
        return min(ms, key=lambda m: float(((m[:, :2].mean(axis=0) - (w / 2, h / 2)) ** 2).sum()))


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Mesh every pairs.txt photo, label its yaw, render the sample's turns and mesh them again."""
    root = a.lfw / "lfw-deepfunneled"
    paths = pairs_photos(a.lfw)
    mesher = Mesher()
    t0 = time.perf_counter()
    meshes = np.full((len(paths), 468, 3), np.nan)
    for i, q in enumerate(paths):
        m = mesher(cv2.imread(str(root / q)))
        if m is not None:
            meshes[i] = m
        if (i + 1) % 2000 == 0:
            log.info("%d/%d meshed, %.0f s", i + 1, len(paths), time.perf_counter() - t0)
    found = np.isfinite(meshes[:, 0, 0])
    template, lateral, mirror = build_template(meshes[found])
    yaw = np.array([mesh_yaw(m, template, lateral) if f else np.nan for m, f in zip(meshes, found, strict=True)])
    tris = tessellation()
    row = {q: i for i, q in enumerate(paths)}
    smp = [q for q in sample(paths, a.photos) if found[row[q]]]
    remeshed = np.full((len(smp), len(ANGLES)), np.nan)
    t1 = time.perf_counter()
    for k, q in enumerate(smp):
        img, m = cv2.imread(str(root / q)), meshes[row[q]]
        for j, deg in enumerate(ANGLES):
            r = render_turn(img, m, tris, turn_side(q) * deg)
            mm = mesher(r)
            remeshed[k, j] = np.nan if mm is None else mesh_yaw(mm, template, lateral)
            if a.png_dir is not None and k < a.png_count:
                a.png_dir.mkdir(parents=True, exist_ok=True)
                cv2.imwrite(str(a.png_dir / f"{k:02d}_{deg:02d}.png"), r)
    log.info("%d photos turned and meshed again, %.0f s", len(smp), time.perf_counter() - t1)
    pair_ok = float(np.mean(mirror[mirror] == np.arange(len(mirror))))
    return {
        "paths": np.asarray(paths),
        "mesh": meshes.astype(np.float32),
        "yaw": yaw,
        "template": template,
        "lateral": lateral,
        "mirror": mirror,
        "mirror_involution": np.float64(pair_ok),
        "triangles": tris,
        "angles": np.asarray(ANGLES),
        "sample": np.asarray(smp),
        "sample_side": np.asarray([turn_side(q) for q in smp]),
        "remeshed_yaw": remeshed,
        "seconds": np.asarray([t1 - t0, time.perf_counter() - t1]),
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lfw", type=Path, default=Path(os.environ.get("FACEGATE_LFW_ROOT", "/work/shared/data/lfw")))
    ap.add_argument("--photos", type=int, default=600, help="photos to turn (evenly spaced over pairs.txt's)")
    ap.add_argument("--out", type=Path, default=Path("out/pose_mesh.npz"))
    ap.add_argument("--png-dir", type=Path, help="write the first --png-count photos' turns here, to look at")
    ap.add_argument("--png-count", type=int, default=6)
    a = ap.parse_args()
    r = run(a)
    import mediapipe as mp

    r["versions"] = np.asarray(f"mediapipe {mp.__version__}, opencv {cv2.__version__}, numpy {np.__version__}")
    r["command"] = np.asarray("/work/venv-mp/bin/python benchmarks/pose_mesh.py " + " ".join(sys.argv[1:]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **r)
    log.info("mirror pairing an involution on %.1f %% of vertices; wrote %s", 100 * r["mirror_involution"], a.out)


if __name__ == "__main__":
    main()
