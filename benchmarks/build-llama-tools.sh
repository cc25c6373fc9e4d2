#!/usr/bin/env bash
# Build llama.cpp's own llama-speculative-simple, llama-bench and rpc-server (with shared libraries that have the
# RPC backend) from the llama.cpp source vendored in the llama-cpp-python sdist of the installed version, so
# benchmarks compare against the same llama.cpp and the RPC tests run against a server of the same protocol.
# Also builds test-llama-archs, which writes tiny random-weight GGUF models of many architectures
# (test-llama-archs -a ARCH -o DIR -s SEED), for tests that need a real hybrid/recurrent model.
# Usage: benchmarks/build-llama-tools.sh [BUILD_DIR]   (default: ~/.cache/llamaspec/llama-tools)
# Extra CMake flags (e.g. -DGGML_CUDA=ON) go in CMAKE_EXTRA.
set -euo pipefail
OUT=${1:-$HOME/.cache/llamaspec/llama-tools}
VER=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
mkdir -p "$OUT"
BINS=(llama-speculative-simple llama-bench rpc-server test-llama-archs)
have_all=1
for b in "${BINS[@]}"; do [ -x "$OUT/bin/$b" ] || have_all=0; done
if [ "$have_all" = 1 ] && [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$VER" ]; then
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
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_RPC=ON ${CMAKE_EXTRA:-} >&2
# tests ON adds many test targets; only the ones named here get built
cmake --build "$OUT/build" -j"$(nproc)" \
  --target llama-speculative-simple llama-bench ggml-rpc-server test-llama-archs >&2
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-speculative-simple" "$OUT/build/bin/llama-bench" "$OUT/build/bin/test-llama-archs" "$OUT/bin/"
cp "$OUT/build/bin/ggml-rpc-server" "$OUT/bin/rpc-server"
cp -P "$OUT"/build/bin/*.so* "$OUT/bin/" 2>/dev/null || true
echo "$VER" > "$OUT/VERSION"
echo "$OUT/bin"
