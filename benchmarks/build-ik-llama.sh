#!/usr/bin/env bash
# Build ik_llama.cpp's llama-server (https://github.com/ikawrakow/ik_llama.cpp), a benchmark peer of
# bench_engine.py (--ik-tools) and session_replay.py (--ik-server), from a source tree or a .tar.gz of one.
# Usage: benchmarks/build-ik-llama.sh SRC [BUILD_DIR] [JOBS]   (BUILD_DIR default: ~/.cache/llamaspec/ik-llama)
# Prints the folder holding llama-server. Extra CMake flags go in CMAKE_EXTRA (the default is a CUDA build:
# CMAKE_EXTRA="-DCMAKE_CUDA_ARCHITECTURES=90" for one GPU generation; IK_CPU=1 builds for the CPU).
#
# What it does to the source (a copy, beside the build):
# - a source packed without its docs, tests and web-UI sources needs an empty pocs/CMakeLists.txt, placeholder
#   server assets and scripts/xxd.cmake (the server embeds its assets with it): written where missing;
# - IK_TRIM=1 (the default) keeps the CUDA mmq kernels of the quant types the benchmark files use (Q4_0, Q4_1,
#   Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; a model of another type aborts there) and configures -DGGML_IQK_FA_ALL_QUANTS=OFF:
#   the full build compiles ~70 mmq instance files and took about 20 minutes on 16 cores, the trimmed one about 10.
# An interrupted build resumes where it stopped (ninja), so it can run across several shorter commands.
set -euo pipefail
SRC_IN=${1:?usage: build-ik-llama.sh SRC [BUILD_DIR] [JOBS]}
OUT=${2:-$HOME/.cache/llamaspec/ik-llama}
JOBS=${3:-$(nproc)}
mkdir -p "$OUT"
SRC="$OUT/ik_llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  rm -rf "$SRC"
  if [ -d "$SRC_IN" ]; then cp -r "$SRC_IN" "$SRC"
  else mkdir -p "$OUT/unpack" && tar xzf "$SRC_IN" -C "$OUT/unpack" && mv "$OUT"/unpack/* "$SRC" && rmdir "$OUT/unpack"
  fi
fi
[ -f "$SRC/CMakeLists.txt" ] || { echo "error: $SRC_IN holds no ik_llama.cpp source (no CMakeLists.txt)" >&2; exit 2; }
mkdir -p "$SRC/pocs" "$SRC/scripts"
[ -f "$SRC/pocs/CMakeLists.txt" ] || : > "$SRC/pocs/CMakeLists.txt"
for f in public/index.html.gz public/loading.html public_llamacpp/index_llamacpp.html.gz public_llamacpp/loading.html; do
  mkdir -p "$(dirname "$SRC/examples/server/$f")"
  [ -f "$SRC/examples/server/$f" ] || echo "benchmark build: no web UI" > "$SRC/examples/server/$f"
done
if [ ! -f "$SRC/scripts/xxd.cmake" ]; then   # xxd -i in CMake: unsigned char NAME[] = {...}; unsigned int NAME_len
  cat > "$SRC/scripts/xxd.cmake" <<'EOF'
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" hexlen)
math(EXPR len "${hexlen} / 2")
get_filename_component(name "${INPUT}" NAME)
string(REGEX REPLACE "[.-]" "_" name "${name}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
file(WRITE "${OUTPUT}" "unsigned char ${name}[] = {${bytes}};\nunsigned int ${name}_len = ${len};\n")
EOF
fi
TRIM=()
if [ "${IK_TRIM:-1}" = 1 ] && [ ! -f "$OUT/trimmed" ]; then
  python3 - "$SRC/ggml/src/ggml-cuda" <<'EOF'
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
keep = {"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
for name in ("mmq.cu", "mmq_id.cu"):
    p = root / name
    if p.is_file():
        p.write_text(re.sub(r"(mul_mat_q_case(?:_id)?)<GGML_TYPE_(\w+)>\(ctx, args, stream\);",
                            lambda m: m.group(0) if m.group(2) in keep else 'GGML_ABORT("quant type not built");',
                            p.read_text()))
gone = 0
for f in sorted((root / "template-instances").glob("mmq-instance-*.cu")):
    types = re.findall(r"DECL_MMQ_CASE\(GGML_TYPE_(\w+)\)", f.read_text())
    if types and not set(types) & keep:
        f.unlink()
        gone += 1
print(f"trimmed: {gone} mmq instance files removed", file=sys.stderr)
EOF
  touch "$OUT/trimmed"
fi
[ "${IK_TRIM:-1}" = 1 ] && TRIM=(-DGGML_IQK_FA_ALL_QUANTS=OFF)
GPU=(-DGGML_CUDA=ON)
[ -n "${IK_CPU:-}" ] && GPU=()
if [ ! -f "$OUT/build/build.ninja" ]; then
  cmake -S "$SRC" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${GPU[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF "${TRIM[@]}" ${CMAKE_EXTRA:-} >&2
fi
cmake --build "$OUT/build" -j"$JOBS" --target llama-server >&2
echo "$OUT/build/bin"
