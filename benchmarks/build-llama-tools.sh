#!/usr/bin/env bash
# Build llama.cpp's own llama-speculative-simple, llama-bench and rpc-server (with shared libraries that have the
# RPC backend) from the llama.cpp source vendored in the llama-cpp-python sdist of the installed version, so
# benchmarks compare against the same llama.cpp and the RPC tests run against a server of the same protocol.
# Usage: benchmarks/build-llama-tools.sh [BUILD_DIR]   (default: ~/.cache/llamaspec/llama-tools)
# Extra CMake flags (e.g. -DGGML_CUDA=ON) go in CMAKE_EXTRA.
set -euo pipefail
OUT=${1:-$HOME/.cache/llamaspec/llama-tools}
VER=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
mkdir -p "$OUT"
if [ -x "$OUT/bin/llama-speculative-simple" ] && [ -x "$OUT/bin/rpc-server" ] && [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$VER" ]; then
  echo "$OUT/bin"; exit 0
fi
# the source stays beside the build, so an interrupted build resumes where it stopped
SRC="$OUT/src/llama_cpp_python-$VER/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  rm -rf "$OUT/src" "$OUT/build"; mkdir -p "$OUT/src"
  python -m pip download -q --no-deps --no-binary :all: -d "$OUT/src" "llama-cpp-python==$VER" >&2
  tar xzf "$OUT/src/llama_cpp_python-$VER.tar.gz" -C "$OUT/src"
fi
if [ -f "$OUT/build/CMakeCache.txt" ] && ! grep -q "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC\$" "$OUT/build/CMakeCache.txt"; then
  rm -rf "$OUT/build"  # configured from another source folder
fi
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_RPC=ON ${CMAKE_EXTRA:-} >&2
cmake --build "$OUT/build" -j"$(nproc)" --target llama-speculative-simple llama-bench ggml-rpc-server >&2
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-speculative-simple" "$OUT/build/bin/llama-bench" "$OUT/bin/"
cp "$OUT/build/bin/ggml-rpc-server" "$OUT/bin/rpc-server"
cp -P "$OUT"/build/bin/*.so* "$OUT/bin/" 2>/dev/null || true
echo "$VER" > "$OUT/VERSION"
echo "$OUT/bin"
