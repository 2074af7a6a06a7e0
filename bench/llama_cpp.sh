#!/usr/bin/env bash
# Builds the peer, llama.cpp's llama-server, from the llama-cpp-python sdist's vendored sources,
# and converts the bundled SmolLM2-135M to an F32 GGUF with the vendored converter.
# Everything lands under build/llama_cpp/ (git ignores build/); each stage is skipped when its
# output exists, so a rerun resumes. Then run the comparison:  python bench/llama_cpp.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=build/llama_cpp
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir -p "$DIR"

if [ ! -f "$DIR/llama_cpp_python-$VERSION.tar.gz" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR"
fi
[ -d "$SRC" ] || tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"

if [ ! -x "$DIR/bin/llama-server" ]; then
  # No web UI download, no HTTPS, no tests: the server binary and nothing from outside.
  cmake -S "$SRC" -B "$DIR/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  cmake --build "$DIR/cmake" --target llama-server -j "${JOBS:-2}"
  mkdir -p "$DIR/bin" && cp "$DIR/cmake/bin/llama-server" "$DIR/bin/"
fi

GGUF=$DIR/smollm2-135m-f32.gguf
if [ ! -f "$GGUF" ]; then
  MODEL_DIR=$("$PY" -c 'from minicb.model.loader import resolve; print(resolve("smollm2-135m")[1])')
  # The vendored gguf-py goes first on the path, so the converter and its library match. The
  # converter imports sentencepiece before it looks for a tokenizer.model; SmolLM2 has none
  # (a BPE tokenizer.json), so an empty stand-in module lets it go on to that.
  mkdir -p "$DIR/stub/sentencepiece"
  echo "SentencePieceProcessor = None" > "$DIR/stub/sentencepiece/__init__.py"
  PYTHONPATH="$SRC/gguf-py:$DIR/stub" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
    --outtype f32 --outfile "$GGUF.tmp"
  mv "$GGUF.tmp" "$GGUF"
fi
echo "llama-server: $DIR/bin/llama-server"
echo "model: $GGUF"
