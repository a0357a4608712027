#!/bin/sh
# The image's build steps, run by the Dockerfile and by CI (tests/deploy/test_docker_build.py
# runs it outside Docker, in a copy of the build context, with the environment the
# Dockerfile gives it).
#
#   build.sh wheels DIR    in a source tree (the build context): DIR gets the project's
#                          wheel and wheels of its dependencies, redis extra included
#   build.sh install DIR   installs those wheels into the Python on PATH, offline, and
#                          checks that the per-chunk modules are compiled if they were asked for
#
# HEADROOM_MYPYC (the Dockerfile's build argument, 1 unless set): 1 compiles the per-chunk
# modules (proxy/speedups.py) with mypyc, 0 builds a pure-Python wheel.
#
# The wheels are built in a virtualenv of their own, made here, so that the one Python
# variable setup.py reads, HEADROOM_MYPYC, is seen only by the build that is meant to
# compile: the project's dependencies, which mypyc type-checks against, are installed
# with HEADROOM_MYPYC=0 (setup.py in pip's isolated build environment has no mypy).
set -eu

mypyc="${HEADROOM_MYPYC-1}"
case "$mypyc" in
    0 | 1) ;;
    *) echo "build.sh: HEADROOM_MYPYC must be 0 or 1, got '$mypyc'" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"

usage() {
    echo "usage: build.sh wheels DIR | build.sh install DIR" >&2
    exit 2
}

compiler() {
    # mypyc's C extensions need a C compiler; the slim images have none.
    if command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "build.sh: HEADROOM_MYPYC=1 needs a C compiler (gcc) and none is installed" >&2
        exit 1
    fi
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev
    rm -rf /var/lib/apt/lists/*
}

wheels() {
    out="$1"
    [ -f pyproject.toml ] && [ -f setup.py ] && [ -d proxy ] || {
        echo "build.sh wheels: run it in the source tree (pyproject.toml, setup.py, proxy/)" >&2
        exit 2
    }
    scratch="$(mktemp -d)"
    # The builds write setuptools' build/ (mypyc's C sources too) and the project's
    # .egg-info into the source tree: those the tree did not have before are removed when
    # the script ends (unless DIR is inside one; *.egg-info, matching nothing yet, is
    # expanded then). mypy's cache goes to the scratch directory.
    created=""
    mkdir -p "$out"
    out_dir="$(cd "$out" && pwd)/"
    for path in build .mypy_cache *.egg-info; do
        [ -e "$path" ] && continue
        case "$out_dir" in "$PWD/$path/"*) continue ;; esac
        created="$created $path"
    done
    trap 'rm -rf "$scratch" $created' EXIT
    export MYPY_CACHE_DIR="$scratch/mypy-cache"
    "$python" -m venv "$scratch/venv"
    pip="$scratch/venv/bin/python -m pip"
    $pip install 'setuptools>=68' wheel
    if [ "$mypyc" = 1 ]; then
        compiler
        # mypyc type-checks what it compiles, and the modules those import, against the
        # installed dependencies: the optional extras' too (the otel extra's types), here
        # only, not in the image.
        HEADROOM_MYPYC=0 $pip install 'mypy>=1.10' types-PyYAML '.[redis,otel]'
    fi
    # The redis extra: admission.backend: redis (several gateways sharing caps).
    HEADROOM_MYPYC="$mypyc" $pip wheel --no-build-isolation --wheel-dir "$out" '.[redis]'
}

install() {
    wheel_dir="$1"
    "$python" -m pip install --no-cache-dir --no-index --find-links="$wheel_dir" \
        'headroom-proxy[redis]'
    if [ "$mypyc" = 1 ]; then
        # Run from elsewhere than a source tree, so the installed package is the one checked.
        (cd / && "$python" -m proxy.speedups --require-compiled)
    fi
}

[ "$#" -eq 2 ] || usage
case "$1" in
    wheels) wheels "$2" ;;
    install) install "$2" ;;
    *) usage ;;
esac
