#!/usr/bin/env bash
# Install llm-gateway as a systemd service, from a checkout of this repository, as root.
#
#   sudo deploy/install.sh                   # one llm-gateway.service (GPU build, H200 profile)
#   sudo deploy/install.sh --gpus 4          # llm-gateway@0..3, ports 8000..8003, one GPU each
#   sudo deploy/install.sh --gpus 1 --replicas-per-gpu 2 --nginx   # two engines share GPU 0
#   sudo deploy/install.sh --nginx           # also the nginx site (upstream filled for the ports)
#
# Options:
#   --gpus N        one instance per GPU (llm-gateway@.service) instead of llm-gateway.service
#   --replicas-per-gpu R
#                   R instances per GPU (with --gpus): instance i on GPU i / R, port 8000 + i, each
#                   with 1/R of the profile's gpu_memory_utilization less 0.05; the instances of one GPU start
#                   one after another (each engine checks the free memory when it starts). One engine
#                   is bound by its own CPU work per step, so a second one on the same H200 adds
#                   throughput; put nginx (--nginx) in front for one address
#   --config FILE   profile installed as /etc/llm-gateway/config.yaml if that file does not exist
#                   yet (default: configs/gemma4-e2b-h200.yaml)
#   --device D      engine build to install: gpu (default) or cpu
#   --nginx         install nginx/llm-gateway.conf and the snippet into /etc/nginx (not reloaded)
#   --no-start      enable the unit(s) but do not start them
# Environment:
#   PREFIX          where the virtualenv and docs go (default /opt/llm-gateway; the units expect it)
#   PYTHON          interpreter for the virtualenv (default python3)
#   DESTDIR         stage the files under this root instead of / (packaging, tests): no user is
#                   created, nothing is pip-installed, systemctl is not called (printed instead)
#
# What it does, in order (each step is idempotent; existing config files are never overwritten):
#   1. useradd --system llm-gateway (home /var/lib/llm-gateway, no login shell)
#   2. $PREFIX/venv with this checkout pip-installed (".[gpu]" or ".[cpu]")
#   3. /etc/llm-gateway/{config.yaml,llm-gateway.env} (+ instance-N.env with the port per GPU)
#   4. the unit file(s) into /etc/systemd/system, `systemctl daemon-reload`
#   5. `systemctl enable --now` the unit(s)
set -euo pipefail

SRC="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="${PREFIX:-/opt/llm-gateway}"
PYTHON="${PYTHON:-python3}"
DESTDIR="${DESTDIR:-}"
GPUS=0
REPLICAS=1
CONFIG="$SRC/configs/gemma4-e2b-h200.yaml"
DEVICE=gpu
NGINX=0
START=1
BASE_PORT=8000

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS="$2"; shift 2 ;;
    --replicas-per-gpu) REPLICAS="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --nginx) NGINX=1; shift ;;
    --no-start) START=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option: $1" >&2; usage 2 >&2 ;;
  esac
done
case "$GPUS" in ''|*[!0-9]*) echo "--gpus needs a number" >&2; exit 2 ;; esac
case "$REPLICAS" in ''|0|*[!0-9]*) echo "--replicas-per-gpu needs a number >= 1" >&2; exit 2 ;; esac
if [ "$REPLICAS" -gt 1 ] && [ "$GPUS" -eq 0 ]; then echo "--replicas-per-gpu needs --gpus N" >&2; exit 2; fi
INSTANCES=$((GPUS * REPLICAS))
case "$DEVICE" in gpu|cpu) ;; *) echo "--device must be gpu or cpu" >&2; exit 2 ;; esac
[ -f "$CONFIG" ] || { echo "config not found: $CONFIG" >&2; exit 2; }
if [ -z "$DESTDIR" ] && [ "$(id -u)" -ne 0 ]; then echo "run as root (or set DESTDIR to stage)" >&2; exit 1; fi

step() { echo "==> $*"; }
# Commands that change the live system: run them, or only print them when staging.
sys() { if [ -n "$DESTDIR" ]; then echo "    (DESTDIR set, not run) $*"; else echo "    $*"; "$@"; fi; }
# Install a file unless it exists (configuration the operator may have edited).
install_new() { # mode src dst
  if [ -e "$DESTDIR$3" ]; then echo "    kept existing $3"; else install -D -m "$1" "$2" "$DESTDIR$3"; echo "    $3"; fi
}

step "user and group llm-gateway"
if getent passwd llm-gateway >/dev/null 2>&1; then
  echo "    exists"
else
  sys useradd --system --user-group --home-dir /var/lib/llm-gateway --no-create-home \
    --shell /usr/sbin/nologin --comment "llm-gateway service" llm-gateway
fi

step "virtualenv $PREFIX/venv with llm-gateway[$DEVICE]"
sys "$PYTHON" -m venv "$PREFIX/venv"
sys "$PREFIX/venv/bin/python" -m pip install --upgrade pip
sys "$PREFIX/venv/bin/python" -m pip install "$SRC[$DEVICE]"
install -D -m 0644 "$SRC/docs/deploy.md" "$DESTDIR$PREFIX/docs/deploy.md"

step "configuration in /etc/llm-gateway"
install -d -m 0750 "$DESTDIR/etc/llm-gateway"
install_new 0640 "$CONFIG" /etc/llm-gateway/config.yaml
install_new 0640 "$SRC/systemd/llm-gateway.env.example" /etc/llm-gateway/llm-gateway.env
units=()
if [ "$GPUS" -gt 0 ]; then
  # The profile's memory share, split between the replicas of one GPU, each leaving 0.07 of the GPU
  # for what an engine holds beyond vLLM's own accounting (server/replicas/supervisor.memory_share).
  share=$(sed -n 's/^ *gpu_memory_utilization: *\([0-9.]*\).*/\1/p' "$CONFIG" | head -1)
  replica_share=$(awk -v s="${share:-0.90}" -v r="$REPLICAS" \
    'BEGIN { x = s / r - (r > 1 ? 0.07 : 0); printf "%.2f", int(x * 100 + 1e-9) / 100 }')
  for ((i = 0; i < INSTANCES; i++)); do
    gpu=$((i / REPLICAS))
    tmp="$(mktemp)"
    {
      printf '# llm-gateway@%d: GPU %d\nLLM_GATEWAY_SERVER__PORT=%d\nCUDA_VISIBLE_DEVICES=%d\n' "$i" "$gpu" "$((BASE_PORT + i))" "$gpu"
      if [ "$REPLICAS" -gt 1 ]; then
        printf '# one of %d engines on GPU %d: its share of the memory\n' "$REPLICAS" "$gpu"
        printf 'LLM_GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION=%s\n' "$replica_share"
      fi
    } > "$tmp"
    install_new 0640 "$tmp" "/etc/llm-gateway/instance-$i.env"
    rm -f "$tmp"
    if [ $((i % REPLICAS)) -gt 0 ]; then
      # Started after the previous replica of its GPU is ready (Type=notify: READY=1), so each
      # engine's memory check sees the other's memory already taken.
      tmp="$(mktemp)"
      printf '[Unit]\n# replica %d of GPU %d: start after the previous one is ready\nAfter=llm-gateway@%d.service\n' \
        "$((i % REPLICAS))" "$gpu" "$((i - 1))" > "$tmp"
      install -D -m 0644 "$tmp" "$DESTDIR/etc/systemd/system/llm-gateway@$i.service.d/10-replica.conf"
      rm -f "$tmp"
      echo "    /etc/systemd/system/llm-gateway@$i.service.d/10-replica.conf"
    fi
    units+=("llm-gateway@$i.service")
  done
else
  units+=("llm-gateway.service")
fi
if [ -z "$DESTDIR" ]; then chgrp -R llm-gateway /etc/llm-gateway; fi

step "systemd unit(s) in /etc/systemd/system"
if [ "$GPUS" -gt 0 ]; then unit_file=llm-gateway@.service; else unit_file=llm-gateway.service; fi
install -D -m 0644 "$SRC/systemd/$unit_file" "$DESTDIR/etc/systemd/system/$unit_file"
echo "    /etc/systemd/system/$unit_file"
if [ "$PREFIX" != /opt/llm-gateway ]; then
  sed -i "s#/opt/llm-gateway/#$PREFIX/#g" "$DESTDIR/etc/systemd/system/$unit_file"
fi
sys systemctl daemon-reload

if [ "$NGINX" -eq 1 ]; then
  step "nginx site /etc/nginx/conf.d/llm-gateway.conf (check with nginx -t, then systemctl reload nginx)"
  install_new 0644 "$SRC/nginx/llm-gateway-proxy.conf" /etc/nginx/snippets/llm-gateway-proxy.conf
  if [ ! -e "$DESTDIR/etc/nginx/conf.d/llm-gateway.conf" ]; then
    servers=""
    if [ "$GPUS" -gt 0 ]; then
      for ((i = 0; i < INSTANCES; i++)); do
        servers+="    server 127.0.0.1:$((BASE_PORT + i)) max_fails=3 fail_timeout=10s;\n"
      done
    else
      servers="    server 127.0.0.1:$BASE_PORT max_fails=3 fail_timeout=10s;\n"
    fi
    install -d "$DESTDIR/etc/nginx/conf.d"
    # Replace the shipped server lines (active and commented) with one per instance.
    awk -v servers="$servers" '
      /^upstream llm_gateway \{/ { inup = 1 }
      inup && /^    #?server 127\.0\.0\.1:[0-9]+ / { if (!done) { printf "%s", servers; done = 1 } next }
      inup && /^\}/ { inup = 0 }
      { print }' "$SRC/nginx/llm-gateway.conf" > "$DESTDIR/etc/nginx/conf.d/llm-gateway.conf"
    echo "    /etc/nginx/conf.d/llm-gateway.conf"
  else
    echo "    kept existing /etc/nginx/conf.d/llm-gateway.conf"
  fi
fi

if [ "$START" -eq 1 ]; then
  step "enable and start: ${units[*]} (the first start loads the model and may capture CUDA graphs: minutes)"
  sys systemctl enable --now "${units[@]}"
else
  step "enable: ${units[*]}"
  sys systemctl enable "${units[@]}"
fi

cat <<MSG
==> done. Next:
    systemctl status ${units[0]}         # STATUS= line: "starting the engine" -> "serving ..."
    journalctl -u ${units[0]} -f         # the gateway's log
    systemctl reload ${units[0]}         # SIGHUP: hot reload where supported
    edit /etc/llm-gateway/config.yaml and /etc/llm-gateway/llm-gateway.env, then restart
MSG
