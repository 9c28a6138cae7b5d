#!/usr/bin/env bash
# Build (and with --push, push) coderai images, one per flavor, from the repository root as build context.
#
#   docker/build.sh [--prefix REGISTRY/NAME] [--tag TAG] [--push] [--dry-run] [FLAVOR ...]
#
# Images are named <prefix>-<flavor>:<tag> (default prefix "coderai", tag: the version in pyproject.toml), the
# names compose/.env's IMAGE_PREFIX, IMAGE_TAG and WORKER_FLAVOR pick from. Without flavors: all of them.
# Needs docker with buildx. Sign what you pushed with scripts/sign-images.sh.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

# flavor -> Dockerfile and build args
declare -A FILE=(
  [cpu]=Dockerfile.cpu
  [llama-cuda]=Dockerfile.llama-cuda
  [media]=Dockerfile.media
  [media-cpu]=Dockerfile.media
  [diffusers]=Dockerfile.media
  [whisper]=Dockerfile.media
  [vllm]=Dockerfile.vllm
)
declare -A ARGS=(
  [cpu]=""
  [llama-cuda]=""
  [media]="EXTRAS=llama-python,media"
  [media-cpu]="EXTRAS=llama-python,media TORCH_INDEX=https://download.pytorch.org/whl/cpu"
  [diffusers]="EXTRAS=diffusers"
  [whisper]="EXTRAS=whisper,diarize,tts"
  [vllm]=""
)
ORDER=(cpu llama-cuda media media-cpu diffusers whisper vllm)

prefix="coderai"
tag="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -1)"
push=0
dry=0
flavors=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "build.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -n "${FILE[$1]:-}" ] || { echo "build.sh: unknown flavor $1 (have: ${ORDER[*]})" >&2; exit 2; }
       flavors+=("$1"); shift ;;
  esac
done
[ ${#flavors[@]} -gt 0 ] || flavors=("${ORDER[@]}")
commit="$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"

for flavor in "${flavors[@]}"; do
  cmd=(docker buildx build -f "$root/docker/${FILE[$flavor]}" -t "$prefix-$flavor:$tag"
       --build-arg "VERSION=$tag" --build-arg "COMMIT=$commit")
  for a in ${ARGS[$flavor]}; do cmd+=(--build-arg "$a"); done
  if [ "$push" = 1 ]; then cmd+=(--push); else cmd+=(--load); fi
  cmd+=("$root")
  if [ "$dry" = 1 ]; then
    printf '%q ' "${cmd[@]}"; echo
  else
    echo "== $prefix-$flavor:$tag" >&2
    "${cmd[@]}"
  fi
done
