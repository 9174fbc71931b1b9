"""The ``facegate`` command line: serve | ray | compare | embed | enrol | keys | eval | train-quality | export |
models. Errors print a JSON error object to stderr and exit 2 (bad input) or 1 (anything else); nothing ends in
a traceback unless ``FACEGATE_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from facegate.config import Settings
from facegate.errors import EmptyInputError, FacegateError, InputError, InvalidParameterError, ServerError, raise_first

log = logging.getLogger("facegate")
app = typer.Typer(add_completion=False, no_args_is_help=True, help="facegate: face recognition with a quality gate.")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluations on LFW.")
export_app = typer.Typer(no_args_is_help=True, help="Export models.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys of the server (stored hashed in the data folder).")
app.add_typer(eval_app, name="eval")
app.add_typer(export_app, name="export")
app.add_typer(keys_app, name="keys")

F = TypeVar("F", bound=Callable[..., Any])

DeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | auto")]
PrecisionOpt = Annotated[str, typer.Option(help="fp32 | fp16 | bf16")]
ModelOpt = Annotated[str, typer.Option(help="recognizer name in the registry")]
RtsOpt = Annotated[Path | None, typer.Option(help="ModelScope RTS IR-SE-64 pytorch_model.pt")]
HeadOpt = Annotated[Path | None, typer.Option(help="trained quality-head file")]
MatchOpt = Annotated[float | None, typer.Option(help="match threshold (default: the registry's SFace threshold)")]


def command(group: typer.Typer = app, name: str | None = None) -> Callable[[F], F]:
    """Register a command of ``group`` that configures logging and turns FacegateError (and anything unexpected)
    into a JSON error on stderr and an exit code."""

    def register(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from facegate.logs import configure_logging

            try:
                try:
                    configure_logging()  # FACEGATE_LOG_LEVEL, FACEGATE_LOG_FORMAT (text | json)
                except ValueError as exc:  # an unknown level name
                    msg = f"FACEGATE_LOG_LEVEL: {exc}"
                    raise InvalidParameterError(msg, detail={"field": "FACEGATE_LOG_LEVEL"}) from None
                return fn(*args, **kwargs)
            except FacegateError as exc:
                typer.echo(json.dumps({"error": exc.to_dict()}), err=True)
                raise typer.Exit(2 if isinstance(exc, InputError) else 1) from None
            except Exception as exc:
                if os.environ.get("FACEGATE_DEBUG") == "1":
                    raise
                log.exception("unexpected error")
                error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
                typer.echo(json.dumps({"error": error}), err=True)
                raise typer.Exit(1) from None

        group.command(name)(wrapper)
        return wrapper  # type: ignore[return-value]

    return register


def _command() -> str:
    return " ".join(["facegate", *sys.argv[1:]])


def _settings(**kw: Any) -> Settings:
    """Settings from the environment (``FACEGATE_*``) and the given flags; a bad value is InvalidParameterError
    naming the setting and its variable (exit 2), not an internal error."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    try:
        return Settings(**{k: v for k, v in kw.items() if v is not None})
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            name = ".".join(str(x) for x in e["loc"])
            variable = "FACEGATE_" + "__".join(str(x) for x in e["loc"]).upper()
            problems.append(f"{name} ({variable} or its flag): {e['msg']}")
        raise InvalidParameterError("invalid setting: " + "; ".join(problems), detail={"field": "settings"}) from None
    except SettingsError as exc:  # a value that is not the JSON a list or group takes
        field = re.search(r'field "([^"]+)"', str(exc))
        variable = f"FACEGATE_{field.group(1).upper()}" if field else "FACEGATE_*"
        raise InvalidParameterError(
            f"invalid setting in the environment ({variable}…): {exc}", detail={"field": "settings"}
        ) from None


def _model_files(args: dict[str, Any]) -> None:
    """A model file given by a flag must exist: else InvalidParameterError naming the flag and the file (exit 2)."""
    for k in ("rts_checkpoint", "quality_head"):
        if args.get(k) is not None and not Path(args[k]).is_file():
            raise InvalidParameterError(f"--{k.replace('_', '-')} {args[k]}: no such file", detail={"field": k})


def _model_kw(args: dict[str, Any]) -> dict[str, Any]:
    """The model options of a one-shot command (its ``locals()``), its model files checked (:func:`_model_files`)."""
    _model_files(args)
    return {k: args[k] for k in ("device", "precision", "model", "rts_checkpoint", "quality_head")}


def _echo(value: Any, indent: int | None = 2) -> None:
    typer.echo(json.dumps(value, indent=indent, default=str))


def _pipeline(settings: Settings):
    from facegate.pipeline.pipeline import FacePipeline

    if settings.compile == "auto":  # one-shot commands: no graph capture at start-up
        settings = settings.model_copy(update={"compile": "off"})
    return FacePipeline.from_settings(settings)


def _key_store(settings: Settings):
    from facegate.service.keys import KeyStore

    return KeyStore(settings.data_dir, settings.security.keys_file)


@command()
def serve(
    host: Annotated[str | None, typer.Option(help="bind address")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 7860)")] = None,
    device: DeviceOpt = "auto",
    profile: Annotated[str | None, typer.Option(help="auto | throughput | low-memory | cpu (the serving plan)")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32 | fp16 | bf16 (default: the plan's)")] = None,
    model: ModelOpt = "sface",
    rts_checkpoint: RtsOpt = None,
    quality_head: HeadOpt = None,
    data_dir: Annotated[Path | None, typer.Option(help="gallery data folder")] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="engine batch size")] = None,
    max_wait_ms: Annotated[float | None, typer.Option(help="batch fill wait")] = None,
    compile: Annotated[str | None, typer.Option(help="off | graphs | inductor (CUDA only)")] = None,
    workers: Annotated[int | None, typer.Option(help="front-end processes (≥ 2: models in engine processes)")] = None,
    engines: Annotated[int | None, typer.Option(help="engine processes in all (implies --workers ≥ 2)")] = None,
    engines_per_gpu: Annotated[int | None, typer.Option(help="engine processes sharing one GPU")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="serve any address without API keys")] = False,
) -> None:
    """Serve the HTTP API and the web page (default http://127.0.0.1:7860) with the serving plan chosen for
    this machine (``--profile`` overrides it; explicit flags override the plan)."""
    _model_files(locals())
    # environment variables (FACEGATE_*) apply; flags given here override them (nested groups are merged)
    kw = {k: v for k, v in locals().items() if k not in ("no_auth", "max_batch_size", "max_wait_ms")}
    kw.update(device=None if device == "auto" else device, model=None if model == "sface" else model)
    batch = {k: v for k, v in (("max_batch_size", max_batch_size), ("max_wait_ms", max_wait_ms)) if v is not None}
    settings = _settings(**kw, engine=batch, security={"no_auth": True} if no_auth else {})
    import uvicorn

    from facegate.api.app import create_app, get_state, uvicorn_config
    from facegate.api.drain import exit_quietly_on_sigterm
    from facegate.api.security import check_bind
    from facegate.transport.remote import SWITCH_INTERVAL_S
    from facegate.tuning import make_plan

    exit_quietly_on_sigterm()
    check_bind(settings, _key_store(settings))
    plan = make_plan(settings)
    log.info("%s", plan.summary())
    if plan.workers > 1 or plan.engines > 1:
        from facegate.api.multiprocess import run_multiprocess

        return run_multiprocess(settings, plan)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(settings, plan=plan)
    server = uvicorn.Server(uvicorn_config(app, settings))
    state = get_state(app)
    # a failed load shuts the server down and is raised here, so a misconfigured server does not linger unready
    state.on_load_error = lambda exc: setattr(server, "should_exit", True)
    log.info("facegate listening on http://%s:%d (docs at /docs)", settings.host, settings.port)
    server.run()
    if state.load_error is not None:
        raise state.load_error


DataDirOpt = Annotated[Path | None, typer.Option(help="data folder (default FACEGATE_DATA_DIR)")]


@command(keys_app, "create")
def keys_create(
    name: Annotated[str, typer.Option(help="a label for the key (who or what uses it)")] = "",
    scope: Annotated[list[str] | None, typer.Option(help="read | enrol | admin (repeatable; default read)")] = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Create a key and print it once (JSON: key, id, scopes); only its hash is stored."""
    token, record = _key_store(_settings(data_dir=data_dir)).create(name, scope or ["read"])
    _echo({"key": token, **record.public()}, None)


@command(keys_app, "list")
def keys_list(data_dir: DataDirOpt = None) -> None:
    """List the keys (ids, names, scopes, creation times; never the keys)."""
    _echo([k.public() for k in _key_store(_settings(data_dir=data_dir)).list_keys()])


@command(keys_app, "revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (from `facegate keys list`)")], data_dir: DataDirOpt = None
) -> None:
    """Revoke a key: a running server refuses it within a second."""
    _echo({"revoked": _key_store(_settings(data_dir=data_dir)).revoke(key_id).public()}, None)


@command(name="ray")
def ray_cmd(
    address: Annotated[str | None, typer.Option(help="Ray cluster (host:port, ray://…, auto); default: local")] = None,
    engine_replicas: Annotated[int, typer.Option(min=1, help="engine replicas (one GPU each where there are any)")] = 1,
    max_engine_replicas: Annotated[int | None, typer.Option(help="autoscale the engine replicas up to this")] = None,
    ingress_replicas: Annotated[int, typer.Option(min=1, help="HTTP ingress replicas (CPU)")] = 1,
    metrics_port: Annotated[int | None, typer.Option(help="Ray's Prometheus port of a local node started here")] = None,
    host: Annotated[str | None, typer.Option(help="bind address of the HTTP ingress replicas")] = None,
    port: Annotated[int | None, typer.Option(help="port of the HTTP ingress replicas (default 7860)")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="serve any address without API keys")] = False,
) -> None:
    """Serve the HTTP API on Ray Serve: ingress and engine replicas across a Ray cluster (extra ``ray``)."""
    from facegate.api.security import check_bind

    s = _settings(host=host, port=port, security={"no_auth": True} if no_auth else {})
    check_bind(s, _key_store(s))  # as `facegate serve`, before Ray starts
    try:
        from facegate.scaleout.ray_app import run as ray_run
    except ImportError as exc:
        raise ServerError(f"facegate ray needs Ray Serve: pip install 'facegate[ray]' ({exc})") from None
    replicas = {"engine_replicas": engine_replicas, "max_engine_replicas": max_engine_replicas}
    ray_run(s, address=address, ingress_replicas=ingress_replicas, metrics_port=metrics_port, **replicas)


@command()
def compare(
    img1: Path,
    img2: Path,
    device: DeviceOpt = "cpu",
    precision: PrecisionOpt = "fp32",
    model: ModelOpt = "sface",
    rts_checkpoint: RtsOpt = None,
    quality_head: HeadOpt = None,
) -> None:
    """Compare the largest face of two photos; prints the JSON ``POST /api/compare`` answers (verdict, quality...)."""
    from facegate.api.schemas import CompareResponse
    from facegate.service.enrol import pipeline_faces

    s = _settings(**_model_kw(locals()))
    p = _pipeline(s)
    a, b = outcomes = pipeline_faces(p, [img1, img2], s.limits)
    raise_first(outcomes, ("img1", "img2"))  # as the API answers: the error names its photo
    _echo(CompareResponse.from_result(p.compare_faces(a, b), model=p.spec.name).model_dump(exclude_unset=True))


@command()
def embed(
    folder: Path,
    out: Annotated[Path, typer.Option(help="output file: .npz or .jsonl")],
    device: DeviceOpt = "cpu",
    precision: PrecisionOpt = "fp32",
    model: ModelOpt = "sface",
    rts_checkpoint: RtsOpt = None,
    quality_head: HeadOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, max=4096)] = 32,
) -> None:
    """Embed every face of every image under FOLDER (recursively); unreadable files are skipped with a logged reason."""
    import numpy as np
    from tqdm import tqdm

    from facegate.service.enrol import IMAGE_EXT, read_photo

    if out.suffix not in {".npz", ".jsonl"}:
        raise InvalidParameterError("--out must end in .npz or .jsonl", detail={"field": "out"})
    s = _settings(**_model_kw(locals()))
    try:  # an --out that cannot be written is refused before the work, not after it
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()
    except OSError as exc:
        raise InvalidParameterError(f"cannot write --out {out}: {exc.strerror}", detail={"field": "out"}) from None
    files = sorted(f for f in Path(folder).rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXT)
    if not files:
        raise EmptyInputError(f"no image files under {folder}")
    p = _pipeline(s)
    rows: list[dict[str, Any]] = []
    skipped = 0
    with tqdm(total=len(files), unit="img", desc="embed", file=sys.stderr) as bar:
        for start in range(0, len(files), batch_size):
            chunk = files[start : start + batch_size]
            images, ok = [], []
            for f in chunk:
                try:
                    images.append(read_photo(f, s.limits))
                    ok.append(f)
                except FacegateError as exc:
                    skipped += 1
                    log.warning("skipping %s: %s (%s)", f, exc.message, exc.code)
            if images:
                for f, faces in zip(ok, p.faces_of(images, p.detect(images)), strict=True):  # gated as served
                    if not faces:
                        log.info("no face in %s", f)
                    for k, face in enumerate(faces):
                        accepted = p.enrol_verdict(face).accepted  # `facegate enrol FILE.npz` imports only these
                        rows.append({"path": str(f), "face": k, **face.to_dict(), "enrol_accepted": accepted})
                        rows[-1]["embedding"] = face.embedding
            bar.update(len(chunk))
    if out.suffix == ".npz":
        emb = np.stack([r["embedding"] for r in rows]) if rows else np.zeros((0, p.spec.embedding_dim), np.float32)
        np.savez_compressed(
            out,
            paths=np.array([r["path"] for r in rows]),
            face=np.array([r["face"] for r in rows], np.int32),
            embeddings=emb,
            quality=np.array([r["quality"]["score"] for r in rows], np.float32),
            enrol_accepted=np.array([r["enrol_accepted"] for r in rows], bool),
            boxes=np.array([r["detection"]["box"] for r in rows], np.float32).reshape(-1, 4),
            landmarks=np.array([r["detection"]["landmarks"] for r in rows], np.float32).reshape(-1, 5, 2),
            model=np.array(p.spec.name),
        )
    else:
        with open(out, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r | {"embedding": [round(float(x), 7) for x in r["embedding"]]}) + "\n")
    _echo({"images": len(files), "skipped": skipped, "faces": len(rows), "out": str(out)}, None)


@command()
def enrol(
    source: Annotated[Path, typer.Argument(help="folder per subject, a path,subject_id CSV, or a templates .npz")],
    gallery: Annotated[str, typer.Option(help="gallery name (created when missing)")],
    gallery_url: Annotated[str | None, typer.Option(help="store URL (default: FACEGATE_GALLERY_URL)")] = None,
    report: Annotated[Path | None, typer.Option(help="write the refused images (JSON) here")] = None,
    device: DeviceOpt = "cpu",
    precision: PrecisionOpt = "fp32",
    model: ModelOpt = "sface",
    batch_size: Annotated[int, typer.Option(min=1, max=4096, help="photos per pipeline batch")] = 64,
) -> None:
    """Bulk-enrol photos (resumable: subjects already enrolled from the same files are skipped) or import
    templates (.npz from `facegate embed`, or `ids` + `embeddings`)."""
    from tqdm import tqdm

    from facegate.gallery import open_store
    from facegate.models.registry import get_spec
    from facegate.service import enrol as bulk

    s = _settings(device=device, precision=precision, model=model, gallery_url=gallery_url)
    spec = get_spec(s.model)
    t0 = time.perf_counter()
    with open_store(s.gallery_url, data_dir=s.data_dir) as store:
        have = next((g for g in store.list_galleries() if g.name == gallery), None)
        # the input is read before the gallery is created, so a bad source leaves no empty gallery behind
        if source.suffix == ".npz":  # templates of the gallery's model (of --model for a new gallery)
            name, dim = (have.model, have.dim) if have else (spec.name, spec.embedding_dim)
            ids, emb, q, refused = bulk.read_templates(source, model=name, dim=dim)
            if refused:
                log.warning("%d faces of %s were refused at the enrolment gate: not imported", refused, source)
        else:
            subjects = bulk.plan(source)
            p = _pipeline(s)
        if have is None:
            store.create_gallery(gallery, spec.name, spec.embedding_dim)
        if source.suffix == ".npz":
            with tqdm(total=len(ids), unit="subj", desc="import", file=sys.stderr) as bar:
                n = bulk.import_templates(store, gallery, ids, emb, q, progress=bar.update)
            out: dict[str, object] = {"subjects_imported": n, "faces_refused": refused}
        else:
            with tqdm(total=sum(map(len, subjects.values())), unit="img", desc="enrol", file=sys.stderr) as bar:

                def progress(photos: int, refused: int) -> None:
                    bar.update(photos)
                    bar.set_postfix(refused=refused)  # the bar shows the rate, in images per second

                verdict = p.enrol_verdict if s.quality.enrol_requires_quality else None
                rep = bulk.enrol_photos(
                    store, gallery, subjects, p, s.limits, batch_size=batch_size, progress=progress, verdict=verdict
                )
            out = rep.to_dict()
            refused_images = out.pop("refused")
            if report is not None:
                report.write_text(json.dumps(refused_images, indent=1))
        out["seconds"] = round(time.perf_counter() - t0, 2)
        _echo(out | {"gallery": store.get_gallery(gallery).to_dict()}, None)


def _env_info(settings: Settings) -> dict[str, Any]:
    import platform
    import subprocess

    import torch

    from facegate.tuning import make_plan

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    plan = make_plan(settings)
    return {
        "git_commit": commit,
        "torch": torch.__version__,
        "device": plan.device,
        "gpu": torch.cuda.get_device_name(0) if plan.device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "precision": plan.precision,
        "model": settings.model if settings.rts_checkpoint is None else "irse64_rts",
    }


@command(eval_app, "lfw")
def eval_lfw(
    root: Annotated[Path, typer.Option(envvar="FACEGATE_LFW_ROOT", help="LFW root (lfw-deepfunneled/ + pairs.txt)")],
    out: Annotated[Path, typer.Option(help="JSON output")] = Path("lfw_eval.json"),
    device: DeviceOpt = "cpu",
    precision: PrecisionOpt = "fp32",
    model: ModelOpt = "sface",
    rts_checkpoint: RtsOpt = None,
    quality_head: HeadOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, max=4096)] = 64,
    flip_tta: Annotated[bool, typer.Option(help="also embed the mirrored crop (2× compute)")] = False,
    save_embeddings: Annotated[Path | None, typer.Option(help="also save per-image embeddings (.npz)")] = None,
) -> None:
    """LFW 10-fold accuracy ± std, TAR at FMR 1e-3 and its threshold, written as JSON."""
    import numpy as np
    from tqdm import tqdm

    from facegate.eval.calibrate import calibrate
    from facegate.eval.lfw import embed_lfw, evaluate_scores, pair_images, pair_scores, read_pairs

    s = _settings(**_model_kw(locals()), flip_tta=flip_tta)
    pairs = read_pairs(root, check_images=True)  # a broken LFW root is refused before any model loads
    p = _pipeline(s)
    paths = pair_images(pairs)
    t0 = time.perf_counter()
    with tqdm(total=len(paths), unit="img", desc="lfw", file=sys.stderr) as bar:
        emb = embed_lfw(p, root, paths, batch_size=batch_size, progress=bar.update)
    secs = time.perf_counter() - t0
    scores = pair_scores(pairs, dict(zip(paths, emb["embeddings"], strict=True)))
    calibration = calibrate(emb["embeddings"], np.array([k.split("/", 1)[0] for k in paths]))  # identity: the folder
    report = {
        "protocol": f"LFW View 2, 10 folds, threshold from the other 9 folds; TAR at FMR over all {len(pairs)} pairs",
        **evaluate_scores(scores, pairs),
        "images": len(paths),
        "images_without_face": int(np.isnan(emb["embeddings"]).any(axis=1).sum()),
        "calibration_all_pairs": calibration,
        "seconds": round(secs, 2),
        "env": _env_info(s),
        "command": _command(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if save_embeddings is not None:
        np.savez_compressed(save_embeddings, paths=np.array(paths), **emb)
    shown = ("accuracy_mean", "accuracy_std", "tar_at_fmr", "threshold_at_fmr", "images_without_face", "seconds")
    _echo({k: report[k] for k in shown} | {"calibration_all_pairs": calibration})


@command(export_app, "onnx")
def export_onnx_cmd(
    out: Annotated[Path, typer.Option(help="output .onnx file")],
    model: ModelOpt = "sface",
    rts_checkpoint: RtsOpt = None,
    quality_head: HeadOpt = None,
    opset: Annotated[int, typer.Option(min=13, max=21)] = 17,
) -> None:
    """Write a dynamic-batch ONNX file (uint8 crops → embedding, quality, raw) and check it with ONNX Runtime."""
    from facegate.models.onnx_backend import export_onnx
    from facegate.models.recognizer import build_recognizer
    from facegate.models.registry import get_spec

    _model_files(locals())
    spec = get_spec("irse64_rts" if rts_checkpoint is not None else model)
    _echo(export_onnx(build_recognizer(spec, checkpoint=rts_checkpoint, quality_head=quality_head), out, opset=opset))


@command(name="train-quality")
def train_quality_cmd(
    source: Annotated[list[str], typer.Argument(help="photo folder <root>/<identity>/*.jpg, or .npz feature parts")],
    out: Annotated[Path, typer.Option(help="head file to write")],
    device: DeviceOpt = "cpu",
    epochs: Annotated[int, typer.Option(min=1, max=1000)] = 8,
    kl_scale: Annotated[float, typer.Option(min=0.0)] = 0.1,
    dof: Annotated[int, typer.Option(min=3)] = 32,
    n_random: Annotated[int, typer.Option(min=0, max=32, help="degraded variants per photo")] = 2,
    save_features: Annotated[Path | None, typer.Option(help="also save extracted features (.npz)")] = None,
    match_threshold: MatchOpt = None,
) -> None:
    """Train an RTS quality head (random temperature scaling) on identity-labelled faces."""
    from facegate.models.registry import get_spec
    from facegate.training.rts import RTSConfig, train_quality
    from facegate.tuning import detect_machine

    if device == "auto":  # as the serving plan resolves it
        device = "cuda" if detect_machine().gpus > 0 else "cpu"
    if device not in ("cpu", "cuda"):  # cuda without a CUDA device: refused as the pipeline is built
        raise InvalidParameterError(f"--device {device}: use cpu, cuda or auto", detail={"field": "device"})

    src: Path | list[str] = Path(source[0]) if len(source) == 1 and Path(source[0]).is_dir() else source
    rep = train_quality(
        src,
        out,
        config=RTSConfig(epochs=epochs, kl_scale=kl_scale, dof=dof),
        device=device,
        n_random=n_random,
        save_features=save_features,
        match_threshold=get_spec("sface").thresholds.match if match_threshold is None else match_threshold,
        command=_command(),
    )
    _echo({k: v for k, v in rep.items() if k != "history"})


@command()
def models() -> None:
    """List the model registry with weights sources, calibrated thresholds and 1:N operating points
    (the search threshold for a named FPIR at gallery sizes 1k-1M)."""
    from dataclasses import asdict

    from facegate.models.registry import list_specs
    from facegate.service.fpir import ImpostorTail, operating_points

    out = []
    for spec in list_specs():
        point = (spec.thresholds.match, spec.thresholds.match_fmr)
        tail = ImpostorTail.load(spec.impostors or spec.name, fallback=point)
        points = operating_points(tail, (1_000, 10_000, 100_000, 1_000_000), (1e-2, 1e-3))
        out.append({**asdict(spec), "search_operating_points": points})
    _echo(out)


def main() -> None:
    """Console entry point."""
    app()
