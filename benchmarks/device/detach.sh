# Sourced by the device scripts whose run outlives one call (after env.sh): a command started in its own
# session survives the call while the machine stays warm (it is given back after 30 s idle); later calls
# wait for it. A later call runs in a fresh copy of the working tree, so the run gets its own copy.
#   detach_start NAME CMD...   copy the tree's code to /tmp/NAME/src, run CMD there (log: run.log),
#                              sample the machine every second (machine.csv)
#   detach_wait NAME           until the run ends or this call's $deadline
# Both set DETACH_DIR=/tmp/NAME.
detach_start() {
  local name=$1; shift
  DETACH_DIR=/tmp/$name
  rm -rf "$DETACH_DIR"; mkdir -p "$DETACH_DIR/src"
  tar cf - --exclude=results --exclude=__pycache__ --exclude=.git --exclude=.gpu --exclude=.state --exclude=".venv*" --exclude=.whl . | tar xf - -C "$DETACH_DIR/src"
  # the exit status lands in rc: an ended process can linger as a zombie, which `kill -0` still finds
  ( cd "$DETACH_DIR/src" && PYTHONPATH=/tmp/site:$DETACH_DIR/src setsid nohup bash -c '"$@"; echo $? > "$0/rc"' \
      "$DETACH_DIR" "$@" > "$DETACH_DIR/run.log" 2>&1 < /dev/null & echo $! > "$DETACH_DIR/pid" )
  setsid nohup bash -c 'while :; do
      echo "$(date +%T),$(cut -d" " -f1 /proc/loadavg),$(nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw,memory.used --format=csv,noheader,nounits | head -1)"
      sleep 1
    done' > "$DETACH_DIR/machine.csv" 2>&1 < /dev/null &
  echo "started $name: $*"
}

detach_wait() {
  DETACH_DIR=/tmp/$1
  [ -f "$DETACH_DIR/pid" ] || { echo "nothing started as $1 on this machine"; exit 2; }
  while [ ! -f "$DETACH_DIR/rc" ] && [ $(( SECONDS - t0 )) -lt "$deadline" ]; do sleep 5; done
  if [ -f "$DETACH_DIR/rc" ]; then echo "$1 ended, exit $(cat "$DETACH_DIR/rc")"; else echo "$1 still running"; fi
}
