#!/usr/bin/env bash
# Remove what install.sh installed: stop and disable the units, delete them, the venv, the env file and the
# helpers. The state (NATS store, Redis AOF, keys, node id) stays unless --purge.
#
#   sudo helm-free-deploy/uninstall.sh [--prefix DIR] [--state-dir DIR] [--purge] [--no-stop]
#
#   --prefix DIR      as given to install.sh (default /opt/coderai)
#   --state-dir DIR   as given to install.sh (default PREFIX/var); removed only with --purge
#   --purge           also delete the state directory
#   --no-stop         do not call systemctl (files only; for tests)
set -euo pipefail
prefix="/opt/coderai" state_dir="" purge=0 no_stop=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --state-dir) state_dir="$2"; shift 2 ;;
    --purge) purge=1; shift ;;
    --no-stop) no_stop=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "uninstall.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
prefix="$(realpath -m "$prefix")"
state_dir="$(realpath -m "${state_dir:-$prefix/var}")"
manifest="$prefix/etc/installed-units"
[ -f "$manifest" ] || { echo "uninstall.sh: no $manifest: nothing installed under $prefix?" >&2; exit 1; }
mapfile -t paths < "$manifest"

if [ "$no_stop" = 0 ]; then
  names=()
  for p in "${paths[@]}"; do names+=("$(basename "$p")"); done
  systemctl disable --now "${names[@]}" || true
fi
for p in "${paths[@]}"; do rm -f "$p"; done
[ "$no_stop" = 1 ] || systemctl daemon-reload
rm -rf "$prefix/venv" "$prefix/lib" "$prefix/etc"
if [ "$purge" = 1 ]; then rm -rf "$state_dir"; echo "== removed $state_dir"; else echo "== kept $state_dir (--purge removes it)"; fi
rmdir "$prefix" 2>/dev/null || true
echo "== coderai removed from $prefix"
