#!/usr/bin/env bash
# Install coderai as systemd services, without Docker.
#
#   sudo helm-free-deploy/install.sh --role head --token-file /root/coderai.token [--models-file models.toml]
#   sudo helm-free-deploy/install.sh --role node --token-file /root/coderai.token [--nats-url nats://HEAD:4222]
#
# head: NATS, Redis, gateway, router, scheduler, pod-broker, metrics and a worker. node: a worker only.
#
# Options:
#   --role head|node       required
#   --token T              the cluster token (or --token-file F, or CODERAI_CLUSTER_TOKEN in the environment;
#                          a flag shows in `ps`, the other two do not)
#   --prefix DIR           venv, env file and helpers go here (default /opt/coderai)
#   --state-dir DIR        NATS store, Redis AOF, keys, node id, model caches (default PREFIX/var)
#   --units-dir DIR        where unit files go (default /etc/systemd/system)
#   --user NAME            the system user the services run as (default coderai; created unless --no-start)
#   --spec SPEC            what pip installs (default: this checkout with EXTRAS, e.g. a wheel path also works)
#   --extras LIST          extras for the default spec (head: llama,otel; node: llama)
#   --python PATH          interpreter for the venv, 3.11 or newer (default python3)
#   --nats-url URL         node: the head's NATS when mDNS cannot find it (other subnet)
#   --nats-port N          head: NATS client port (default 4222)
#   --gateway-host ADDR    head: gateway listen address (default 0.0.0.0)
#   --gateway-port N       head: gateway port (default 8000)
#   --redis-port N         head: Redis port, loopback only (default 6380: Debian's own redis keeps 6379)
#   --redis-server PATH    head: redis-server binary (default: found on PATH)
#   --models-file F        head: copied to PREFIX/etc/models.toml and served by the scheduler
#   --no-worker            head: no engines on this machine
#   --skip-install         do not create the venv or pip install (files only; for tests and re-runs)
#   --no-start             write files only: no user, no chown, no systemctl; prints what to run instead
#
# Env: CMAKE_ARGS is passed to pip (llama.cpp's build, e.g. -DGGML_CUDA=on); TORCH_INDEX, when set, installs
# torch (TORCH_SPEC, default torch) from that index first, for the torch-based extras.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"

role="" token="${CODERAI_CLUSTER_TOKEN:-}" prefix="/opt/coderai" state_dir="" units_dir="/etc/systemd/system"
user="coderai" spec="" extras="" python="python3" nats_url="" nats_port=4222 gateway_host="0.0.0.0"
gateway_port=8000 redis_port=6380 redis_server="" models_file="" worker=1 skip_install=0 no_start=0

die() { echo "install.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --role) role="$2"; shift 2 ;;
    --token) token="$2"; shift 2 ;;
    --token-file) token="$(tr -d '\r\n' < "$2")"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --state-dir) state_dir="$2"; shift 2 ;;
    --units-dir) units_dir="$2"; shift 2 ;;
    --user) user="$2"; shift 2 ;;
    --spec) spec="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --nats-url) nats_url="$2"; shift 2 ;;
    --nats-port) nats_port="$2"; shift 2 ;;
    --gateway-host) gateway_host="$2"; shift 2 ;;
    --gateway-port) gateway_port="$2"; shift 2 ;;
    --redis-port) redis_port="$2"; shift 2 ;;
    --redis-server) redis_server="$2"; shift 2 ;;
    --models-file) models_file="$2"; shift 2 ;;
    --no-worker) worker=0; shift ;;
    --skip-install) skip_install=1; shift ;;
    --no-start) no_start=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

[ "$role" = head ] || [ "$role" = node ] || die "--role head|node is required"
[ -n "$token" ] || die "no cluster token: --token-file F, --token T or CODERAI_CLUSTER_TOKEN"
# The env file holds it unquoted: keep to characters systemd and URLs take as they are.
[[ "$token" =~ ^[A-Za-z0-9._~+/=-]+$ ]] || die "the token may hold only letters, digits and . _ ~ + / = -"
for n in "$nats_port" "$gateway_port" "$redis_port"; do [[ "$n" =~ ^[0-9]+$ ]] || die "not a port: $n"; done
[ -z "$models_file" ] || [ -f "$models_file" ] || die "no models file $models_file"
[ "$role" = head ] || [ -z "$models_file" ] || die "--models-file is for the head"

prefix="$(realpath -m "$prefix")"
state_dir="$(realpath -m "${state_dir:-$prefix/var}")"
units_dir="$(realpath -m "$units_dir")"
venv="$prefix/venv" etc_dir="$prefix/etc" lib_dir="$prefix/lib"
env_file="$etc_dir/coderai.env"
group="$user"

if [ "$role" = head ]; then
  redis_server="${redis_server:-$(command -v redis-server || true)}"
  if [ -z "$redis_server" ]; then
    [ "$no_start" = 1 ] || die "redis-server not found: apt-get install redis-server (or --redis-server PATH)"
    redis_server=/usr/bin/redis-server
  fi
fi

mkdir -p "$prefix" "$etc_dir" "$lib_dir" "$units_dir" "$state_dir"
if [ "$role" = head ]; then mkdir -p "$state_dir/nats" "$state_dir/redis"; fi

if [ "$skip_install" = 0 ]; then
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$python is older than 3.11 (--python)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ -n "${TORCH_INDEX:-}" ]; then
    "$venv/bin/python" -m pip install -q --index-url "$TORCH_INDEX" "${TORCH_SPEC:-torch}"
  fi
  if [ -z "$spec" ]; then
    [ -n "$extras" ] || { [ "$role" = head ] && extras="llama,otel" || extras="llama"; }
    spec="$repo[$extras]"
  fi
  echo "== pip install $spec (llama.cpp compiles on first install: minutes)"
  "$venv/bin/python" -m pip install -q "$spec"
fi
install -m 0755 "$repo/docker/head_init.py" "$lib_dir/coderai-init"

# The env file: every coderai unit reads it. Mode 0600 (root's): systemd reads it before dropping privileges.
scrape_token=""
if [ -f "$env_file" ]; then scrape_token="$(sed -n 's/^CODERAI_SCRAPE_TOKEN=//p' "$env_file" | head -1)"; fi
if [ "$role" = head ] && [ -z "$scrape_token" ]; then
  scrape_token="$(LC_ALL=C tr -dc 'A-Za-z0-9' < /dev/urandom | head -c 32 || true)"
fi
redis_password=""
if [ -f "$env_file" ]; then redis_password="$(sed -n 's/^REDIS_PASSWORD=//p' "$env_file" | head -1)"; fi
if [ "$role" = head ] && [ -z "$redis_password" ]; then
  redis_password="$(LC_ALL=C tr -dc 'A-Za-z0-9' < /dev/urandom | head -c 40 || true)"
fi
umask 077
{
  echo "# coderai ($role), written by helm-free-deploy/install.sh. Holds the cluster token: keep it mode 0600."
  echo "# Every variable: docs/env.md. After a change: systemctl restart coderai.target"
  echo "CODERAI_CLUSTER_TOKEN=$token"
  echo "CODERAI_DATA_DIR=$state_dir"
  echo "CODERAI_LOG_FORMAT=json"
  echo "CODERAI_LOG_LEVEL=INFO"
  echo "HF_HOME=$state_dir/hf"
  if [ "$role" = head ]; then
    echo "CODERAI_NATS_URL=nats://127.0.0.1:$nats_port"
    echo "CODERAI_NATS_PASSWORD_FILE=$state_dir/secrets/nats-service.password"
    # each service logs in as its own NATS user (svc-<service>, only the subjects it needs), named by its file
    for svc in gateway router scheduler pod-broker metrics; do
      echo "CODERAI_$(echo "$svc" | tr 'a-z-' 'A-Z_')_NATS_PASSWORD_FILE=$state_dir/secrets/nats-svc-$svc.password"
    done
    echo "CODERAI_NATS_CA=$state_dir/secrets/nats-ca.pem"
    echo "REDIS_PASSWORD=$redis_password"
    echo "CODERAI_REDIS_URL=redis://:$redis_password@127.0.0.1:$redis_port/0"
    echo "CODERAI_SCHEDULER_MEMBERS_FILE=$state_dir/nats/members.json"
    echo "CODERAI_SCHEDULER_NATS_USERS_FILE=$state_dir/nats/users.conf"
    echo "CODERAI_SCHEDULER_NATS_PID_FILE=$state_dir/nats/nats.pid"
    echo "CODERAI_SCRAPE_TOKEN=$scrape_token"
    echo "CODERAI_GATEWAY_HOST=$gateway_host"
    echo "CODERAI_GATEWAY_PORT=$gateway_port"
    echo "CODERAI_GATEWAY_API_KEYS_FILE=$state_dir/keys.toml"
    echo "CODERAI_GATEWAY_METRICS_URL=http://127.0.0.1:9464/metrics"
    echo "CODERAI_METRICS_HOST=127.0.0.1"
    echo "CODERAI_METRICS_PORT=9464"
    echo "CODERAI_WORKER_ANNOUNCE_NATS_PORT=$nats_port"
    if [ -n "$models_file" ]; then echo "CODERAI_SCHEDULER_MODELS_FILE=$etc_dir/models.toml"; fi
  elif [ -n "$nats_url" ]; then
    echo "CODERAI_NATS_URL=$nats_url"
  fi
} > "$env_file.tmp"
chmod 0600 "$env_file.tmp"
mv "$env_file.tmp" "$env_file"
umask 022
if [ -n "$models_file" ]; then install -m 0644 "$models_file" "$etc_dir/models.toml"; fi

units=()
if [ "$role" = head ]; then
  units=(coderai-nats.service coderai-redis.service coderai-gateway.service coderai-router.service
         coderai-scheduler.service coderai-pod-broker.service coderai-metrics.service)
fi
if [ "$role" = node ] || [ "$worker" = 1 ]; then units+=(coderai-worker.service); fi

render() {  # template -> unit: fill placeholders; @HEAD@ lines are kept (unprefixed) on the head only
  local keep='s/^@HEAD@//' drop='/^@HEAD@/d'
  sed -e "$([ "$role" = head ] && echo "$keep" || echo "$drop")" \
      -e "s|@USER@|$user|g" -e "s|@GROUP@|$group|g" -e "s|@ENV_FILE@|$env_file|g" \
      -e "s|@STATE_DIR@|$state_dir|g" -e "s|@VENV@|$venv|g" -e "s|@LIB_DIR@|$lib_dir|g" \
      -e "s|@NATS_PORT@|$nats_port|g" -e "s|@REDIS_PORT@|$redis_port|g" -e "s|@REDIS_SERVER@|$redis_server|g" \
      "$here/units/$1"
}
for u in coderai.target "${units[@]}"; do
  render "$u" > "$units_dir/$u"
  chmod 0644 "$units_dir/$u"
done
printf '%s\n' coderai.target "${units[@]}" | sed "s|^|$units_dir/|" > "$etc_dir/installed-units"
echo "== wrote ${#units[@]} units and coderai.target to $units_dir, the env file $env_file"

next=()
id "$user" >/dev/null 2>&1 || next+=("useradd --system --home-dir $state_dir --shell /usr/sbin/nologin $user")
next+=("chown -R $user:$group $state_dir")
next+=("systemctl daemon-reload")
next+=("systemctl enable --now coderai.target ${units[*]}")
if [ "$no_start" = 1 ]; then
  echo "== --no-start: nothing started. To start:"
  printf '   %s\n' "${next[@]}"
  exit 0
fi
for cmd in "${next[@]}"; do echo "== $cmd"; eval "$cmd"; done
if [ "$role" = head ]; then
  echo "== the admin API key will be in $state_dir/admin.key once the gateway has started"
fi
