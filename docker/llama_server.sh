#!/bin/sh
# llama.cpp's own llama-server (what a GGUF model runs on) and rpc-server (a node's CPU lent to a split model) into
# the image's venv, run by the Dockerfiles' build stages: the ones scripts/images staged in /local/bin (what
# scripts/setup built on the host, portable), else one CPU build of the llama.cpp that pyproject.toml pins, as
# scripts/setup builds it. $1: cmake flags (GGML_NATIVE=OFF: not tuned to the CPU of the build machine).
set -eu
bin=/opt/coderai/venv/bin
if [ -x /local/bin/llama-server ] && [ -x /local/bin/rpc-server ]; then
  cp /local/bin/llama-server /local/bin/rpc-server "$bin/"
else
  apt-get update && apt-get install -y --no-install-recommends build-essential cmake git
  ver="$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' /src/pyproject.toml | head -1)"
  mkdir /tmp/llama && cd /tmp/llama
  "$bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==${ver}"
  tar -xzf llama_cpp_python-*.tar.gz
  # shellcheck disable=SC2086  # $1 is a list of flags
  cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $1
  cmake --build build --target llama-server ggml-rpc-server -j"$(nproc)"
  cp build/bin/llama-server "$bin/"
  cp build/bin/ggml-rpc-server "$bin/rpc-server"
  cd / && rm -rf /tmp/llama
fi
"$bin/llama-server" --version
