#!/usr/bin/env bash
# Sign pushed coderai images with cosign, by digest, with the release's version and commit as annotations.
#
#   COSIGN_KEY=cosign.key scripts/sign-images.sh [--version V] [--commit C] [--dry-run] IMAGE[:TAG] ...
#
# Each IMAGE is resolved to the digest the registry holds now (a multi-arch index is signed as the index), then
#   cosign sign --yes --key "$COSIGN_KEY" -a version=V -a commit=C IMAGE@sha256:...
# so the signature covers exactly those bytes, never a tag that could move later.
#
# Needs: cosign (https://docs.sigstore.dev/cosign/system_config/installation/), a registry login with push
# rights (docker login / cosign login), and one of `docker buildx imagetools`, `crane` or `skopeo` to read
# digests. COSIGN_KEY is a key file (cosign generate-key-pair) or a KMS URI (awskms://, gcpkms://, hashivault://,
# env://VAR); cosign asks for the key's password or reads COSIGN_PASSWORD. --version defaults to pyproject.toml's,
# --commit to `git rev-parse HEAD`. Verify with: cosign verify --key cosign.pub IMAGE (docs/deploy.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="" commit="" dry=0 images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --version) version="$2"; shift 2 ;;
    --commit) commit="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "sign-images.sh: unknown option $1" >&2; exit 2 ;;
    *) images+=("$1"); shift ;;
  esac
done
[ ${#images[@]} -gt 0 ] || { echo "sign-images.sh: name at least one pushed image (see --help)" >&2; exit 2; }
[ -n "${COSIGN_KEY:-}" ] || { echo "sign-images.sh: set COSIGN_KEY (a key file or KMS URI)" >&2; exit 2; }
[ -n "$version" ] || version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | head -1)"
[ -n "$commit" ] || commit="$(git -C "$root" rev-parse HEAD 2>/dev/null || true)"
[ -n "$commit" ] || { echo "sign-images.sh: no git commit here: pass --commit" >&2; exit 2; }
[ "$dry" = 1 ] || command -v cosign >/dev/null || { echo "sign-images.sh: cosign not found" >&2; exit 2; }

# repo[:tag][@digest] -> repo (a registry port, as in localhost:5000/x, is not a tag)
repository() {
  local ref="${1%%@*}" last="${1%%@*}"
  last="${last##*/}"
  if [[ "$last" == *:* ]]; then ref="${ref%:*}"; fi
  echo "$ref"
}

digest_of() {
  local ref="$1" d=""
  if [[ "$ref" == *@sha256:* ]]; then echo "${ref##*@}"; return; fi
  if docker buildx version >/dev/null 2>&1; then
    d="$(docker buildx imagetools inspect "$ref" --format '{{.Manifest.Digest}}' 2>/dev/null || true)"
  fi
  if [ -z "$d" ] && command -v crane >/dev/null; then d="$(crane digest "$ref" 2>/dev/null || true)"; fi
  if [ -z "$d" ] && command -v skopeo >/dev/null; then
    d="$(skopeo inspect --format '{{.Digest}}' "docker://$ref" 2>/dev/null || true)"
  fi
  [[ "$d" == sha256:* ]] || { echo "sign-images.sh: cannot resolve a digest for $ref (pushed? docker buildx, crane or skopeo installed?)" >&2; return 1; }
  echo "$d"
}

for image in "${images[@]}"; do
  digest="$(digest_of "$image")"
  target="$(repository "$image")@$digest"
  cmd=(cosign sign --yes --key "$COSIGN_KEY" -a "version=$version" -a "commit=$commit" "$target")
  if [ "$dry" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; continue; fi
  echo "== signing $image as $target" >&2
  "${cmd[@]}"
done
