#!/usr/bin/env bash
# Builds a side virtualenv in which the real SGLang 0.5.23 server runs on CPU, for checking
# the SGLang adapter without a GPU (opt-in: tests/engine/test_sglang_real.py, or
# `python -m services.engine.gpu_check --cpu --python DIR/bin/python`).
#   bash services/engine/sglang_cpu_env.sh [DIR]      (default .gyre/sglang-cpu, ~1.4 GB)
# It reuses the project venv's packages (torch 2.13 CPU, transformers, fastapi, ...) through a
# .pth file and adds SGLang and its light dependencies with --no-deps (a plain install would
# pull a CUDA torch). Two GPU-only imports are replaced by stubs that fail if ever called:
# sgl_kernel (no CPU build on PyPI) and torchvision (PyPI's build does not load beside the
# CPU torch). Seen working: generate, prefix cache, stream, abort, pause modes, flush,
# tensor/disk/gloo-distributed weight updates, memory release/resume, health_generate.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR="${1:-.gyre/sglang-cpu}"
MAIN_SITE="$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')"
python3 -m venv "$DIR"
SITE="$("$DIR/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
echo "$MAIN_SITE" > "$SITE/gyre_main_venv.pth"
"$DIR/bin/pip" install --quiet --no-deps \
  sglang==0.5.23 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
  apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 cffi==2.1.1 compressed-tensors==0.20.1 dill==0.4.1 \
  einops==0.8.2 frozenlist==1.8.0 ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 \
  orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 propcache==0.5.4 pybase64==1.5.1 \
  pycparser==3.12 python-multipart==0.0.34 pyzmq==27.3.0 sentencepiece==0.2.3 setproctitle==1.3.8 \
  soundfile==0.14.0 traitlets==5.16.1 triton==3.9.0 uvloop==0.23.0 xgrammar==0.2.9 yarl==1.25.1
STUBS="$DIR/gyre_stubs"
mkdir -p "$STUBS/sgl_kernel" "$STUBS/torchvision/transforms/v2" "$STUBS/torchvision/io" "$STUBS/torchvision/ops"
cat > "$STUBS/sgl_kernel/__init__.py" <<'PY'
"""Stub: SGLang imports these kernels at start-up; a tiny model on CPU never calls them."""
__version__ = "0.0.0"
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stub: {name} called")
    return missing
PY
cat > "$STUBS/torchvision/_stub.py" <<'PY'
"""Stub: image/video helpers imported at start-up by multimodal code paths a text model never uses."""
class _Anything:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Anything()
    def __getattr__(self, name): return _Anything()
    def __mro_entries__(self, bases): return (object,)
def module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything()
PY
for d in "" transforms transforms/v2 io ops; do
  printf 'from torchvision._stub import module_getattr as __getattr__\n__version__ = "0.0.0"\n' > "$STUBS/torchvision/$d/__init__.py"
done
printf 'from torchvision._stub import module_getattr as __getattr__\n' > "$STUBS/torchvision/transforms/functional.py"
cp "$STUBS/torchvision/transforms/functional.py" "$STUBS/torchvision/transforms/v2/functional.py"
echo "$(cd "$STUBS" && pwd)" > "$SITE/gyre_stubs.pth"
"$DIR/bin/python" -m sglang.launch_server --help > /dev/null
echo "SGLang CPU env ready: GYRE_SGLANG_PYTHON=$DIR/bin/python"
