#!/usr/bin/env bash
# The docker-compose deployment, run for real: a private Docker engine (host network only), images
# built here from a Debian base bootstrapped here, then what an operator does with
# docker-compose.yml (+ compose.ci.yml, the CI form): the producer one-shot, `up --scale worker=3`,
# scale to 1 and back to 4 mid-run, `docker kill` of a worker in the middle of a job, a stop of a
# worker (it finishes its job first), a collector restart, `harvest status` / `requeue --dry-run`
# through `exec`, a metrics scrape; then the accounting read back from the object store: every
# sample stored exactly once with the right tokens. Then `down -v`, dockerd stopped by its PID and
# its mounts removed. Run by .ci/run; exits 0 with SKIP where no Docker daemon can start here (1
# under CI=true).
#
# Rules it keeps: no bridge network and no private-range network (dockerd --bridge=none, every
# service network_mode: host, builds on the host network), all traffic on 127.0.0.1 at ports of
# its own (6379 belongs to the machine's Redis); it stops only the processes it started, by PID.
#
#   HARVEST_COMPOSE_CACHE  base image tar and Docker data root (default ~/.cache/harvest/compose-ci):
#                          a second run skips the debootstrap and reuses the image layers
#   COMPOSE_CI_FRESH=1     ignore the cache (a fresh machine's timing)
#   COMPOSE_CI_ROWS        dataset rows (default 800)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${HARVEST_COMPOSE_CACHE:-${HARVEST_CACHE:-$HOME/.cache/harvest}/compose-ci}
ROWS=${COMPOSE_CI_ROWS:-800}
RUN_NAME=ci
PROJECT=harvest-ci
PIP_PORT=16999
PORTS=(16379 16900 16000 16108 16181 "$PIP_PORT")   # compose.ci.yml's ports, and the pip mirror's
REDIS_PASSWORD=ci-redis-secret
S3_KEY=ci-s3-user S3_SECRET=ci-s3-secret
WORK=$(mktemp -d /tmp/hcci.XXXXXX)   # short: containerd's sockets live under the exec root
[ "${COMPOSE_CI_FRESH:-0}" = 1 ] && CACHE=$WORK/cache
DATA_ROOT=$CACHE/docker
BASE_TAR=$CACHE/debian-bookworm-minbase.tar.gz
SUMMARY=$WORK/summary
export DOCKER_HOST=unix://$WORK/docker.sock DOCKER_CONFIG=$WORK/dockercfg DOCKER_BUILDKIT=0 COMPOSE_DOCKER_CLI_BUILD=0
DOCKERD_PID="" PIPSRV_PID="" ADDED_POLICY=0 LINKS_BEFORE=""

now() { date +%s.%N; }
lap() { local t; t=$(awk -v a="$(now)" -v b="$2" 'BEGIN {printf "%.1f", a - b}'); printf '[time] %-34s %6ss\n' "$1" "$t" | tee -a "$SUMMARY"; }
note() { echo "$*" | tee -a "$SUMMARY"; }
log() { printf '\n== %s\n' "$*"; }
die() { echo "compose-ci: FAIL: $*" >&2; exit 1; }
skip() {  # under CI=true the deployment run is a part CI must run: no Docker is a failure there
  if [ "${CI:-}" = true ]; then die "$* (CI=true: the deployment run does not skip)"; fi
  echo "compose-ci: SKIP: $*"; exit 0
}
# compose.ci.yml over docker-compose.yml, rendered once (scripts/compose_ci.py render: the ports
# compose v1 refuses on the host network dropped), then run as the one file of the project.
dc() { docker-compose -p "$PROJECT" --project-directory "$REPO" -f "$WORK/compose.yml" "$@"; }
PY=$(python3 -c 'import sys; print(sys.executable)')   # the interpreter itself, not a shim
helper() { "$PY" "$REPO/scripts/compose_ci.py" "$@"; }
export HARVEST_REDIS_URL="redis://:$REDIS_PASSWORD@127.0.0.1:16379/0" CI_RUN=$RUN_NAME

cleanup() {
  local rc=$?
  set +e
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    if [ "$rc" != 0 ]; then
      log "logs (failed run)"; dc --profile cpu logs --tail 30 2>&1 | tail -120
    fi
    dc --profile cpu --profile producer down -v -t 20 >/dev/null 2>&1
    ids=$(docker ps -aq 2>/dev/null); [ -n "$ids" ] && docker rm -f $ids >/dev/null 2>&1
    kill -TERM "$DOCKERD_PID"
    for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && echo "compose-ci: WARNING: dockerd $DOCKERD_PID still running"
  fi
  [ -n "$PIPSRV_PID" ] && kill "$PIPSRV_PID" 2>/dev/null
  # libnetwork leaves its default netns bind mount (nsfs) after a clean stop; unmount whatever is
  # left under the work dir and the data root, deepest first.
  for m in $(awk -v w="$WORK" -v d="$DATA_ROOT" '$2 ~ "^"w || $2 ~ "^"d {print $2}' /proc/mounts | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m"
  done
  [ "$ADDED_POLICY" = 1 ] && rm -f /usr/sbin/policy-rc.d
  local mounts links
  mounts=$(awk -v w="$WORK" -v d="$DATA_ROOT" '$2 ~ "^"w || $2 ~ "^"d' /proc/mounts | wc -l)
  links=$(ip -br link | awk '{print $1}' | sort | tr '\n' ' ')
  if [ -n "$LINKS_BEFORE" ]; then
    note "left behind: containers/daemon: none (dockerd $DOCKERD_PID stopped), mounts: $mounts," \
         "interfaces before: $LINKS_BEFORE after: $links"
    [ "$mounts" = 0 ] && [ "$links" = "$LINKS_BEFORE" ] || { echo "compose-ci: FAIL: something was left behind"; rc=1; }
  fi
  [ -f "$SUMMARY" ] && { log "summary"; cat "$SUMMARY"; }
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
trap 'echo "compose-ci: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

# ---- 1. tools --------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || skip "needs root to start a Docker daemon"
T0=$(now)
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
  log "install docker.io docker-compose debootstrap"
  # docker.io's postinst would start the stock daemon (docker0 on a private range): forbid it.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; ADDED_POLICY=1
  fi
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap; } \
    >"$WORK/apt.log" 2>&1 || skip "docker.io could not be installed: $(tail -1 "$WORK/apt.log")"
  lap "apt install" "$T0"
fi
for p in "${PORTS[@]}"; do
  ss -Hltn "sport = :$p" | grep -q . && die "port 127.0.0.1:$p is taken (compose.ci.yml uses it)"
done
LINKS_BEFORE=$(ip -br link | awk '{print $1}' | sort | tr '\n' ' ')
mkdir -p "$WORK"/{exec,models,data} "$DOCKER_CONFIG" "$DATA_ROOT"

# ---- 2. dockerd --------------------------------------------------------------------------------
log "start dockerd"
T=$(now)
/usr/sbin/dockerd --data-root "$DATA_ROOT" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" -H "$DOCKER_HOST" \
  --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false --userland-proxy=false \
  >"$WORK/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 1 60); do docker version >/dev/null 2>&1 && break; kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
if ! docker version >/dev/null 2>&1; then
  reason=$(grep -m1 -iE 'level=(fatal|error)' "$WORK/dockerd.log" || tail -1 "$WORK/dockerd.log")
  kill -0 "$DOCKERD_PID" 2>/dev/null && kill -TERM "$DOCKERD_PID"; wait "$DOCKERD_PID" 2>/dev/null; DOCKERD_PID=""
  skip "the Docker daemon cannot start here: $reason"
fi
lap "dockerd ready (pid $DOCKERD_PID)" "$T"
docker network ls --format '{{.Driver}}' | grep -q bridge && die "a bridge network exists"

# ---- 3. base image: debootstrap once, then the cached tar ----------------------------------------
log "base image"
T=$(now)
if ! docker image inspect local/debian-raw:bookworm >/dev/null 2>&1; then
  if [ ! -s "$BASE_TAR" ]; then
    mirror=$(awk '/^URIs:/ {print $2; exit} /^deb / {print $2; exit}' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -1)
    debootstrap --variant=minbase bookworm "$WORK/rootfs" "${mirror:-http://deb.debian.org/debian}" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -5 "$WORK/debootstrap.log"; die "debootstrap failed"; }
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*_*
    tar -C "$WORK/rootfs" --numeric-owner -c . | gzip -1 > "$BASE_TAR.tmp" && mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$WORK/rootfs"
    lap "debootstrap bookworm minbase" "$T"
  fi
  T=$(now)
  docker import - local/debian-raw:bookworm < "$BASE_TAR" >/dev/null
  lap "docker import (cached tar)" "$T"
fi
# The machine's pip sources (its index mirror, wheel dirs such as the CPU torch wheel, served on
# 127.0.0.1) and CA bundle: a layer of this machine's base, so the Dockerfile stays the users' one.
mkdir -p "$WORK/baselayer"
helper pip-conf "$WORK/pipsrv" "http://127.0.0.1:$PIP_PORT" "$WORK/baselayer/pip-constraints.txt" > "$WORK/baselayer/pip.conf"
cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$WORK/baselayer/host-ca.crt"
cat > "$WORK/baselayer/Dockerfile" <<'EOF'
FROM local/debian-raw:bookworm
COPY host-ca.crt /etc/ssl/certs/host-ca.crt
COPY pip.conf /etc/pip.conf
COPY pip-constraints.txt /etc/pip-constraints.txt
ENV PIP_CERT=/etc/ssl/certs/host-ca.crt DEBIAN_FRONTEND=noninteractive
EOF
docker build -q --network host -t local/debian:bookworm "$WORK/baselayer" >/dev/null 2>"$WORK/baselayer.log" \
  || { cat "$WORK/baselayer.log"; die "base layer build failed"; }
python3 -m http.server --bind 127.0.0.1 "$PIP_PORT" --directory "$WORK/pipsrv" >"$WORK/pipsrv.log" 2>&1 &
PIPSRV_PID=$!
lap "base image ready" "$T"

# ---- 4. images ---------------------------------------------------------------------------------
log "build (docker-compose build: harvest, harvest-redis, harvest-dashboard)"
sed -e "s/^REDIS_PASSWORD=.*/REDIS_PASSWORD=$REDIS_PASSWORD/" -e "s/^S3_ACCESS_KEY=.*/S3_ACCESS_KEY=$S3_KEY/" \
    -e "s/^S3_SECRET_KEY=.*/S3_SECRET_KEY=$S3_SECRET/" -e "s/^RUN=.*/RUN=$RUN_NAME/" -e "s/^DATASET=.*/DATASET=ci.jsonl/" \
    -e "s|^DATA_DIR=.*|DATA_DIR=$WORK/data|" -e "s|^MODEL_DIR=.*|MODEL_DIR=$WORK/models|" \
    -e "s/^CHUNKED_PREFILL_SIZE=.*/CHUNKED_PREFILL_SIZE=64/" -e "s/^DUMP_TMPFS_SIZE=.*/DUMP_TMPFS_SIZE=1g/" \
    -e "s/^REDIS_MAXMEMORY=.*/REDIS_MAXMEMORY=1gb/" "$REPO/.env.example" > "$WORK/ci.env"
docker-compose -f "$REPO/docker-compose.yml" -f "$REPO/compose.ci.yml" --env-file "$WORK/ci.env" config \
  | helper render > "$WORK/compose.yml"
T=$(now)
dc --profile cpu --profile producer build >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; die "image build failed"; }
lap "docker-compose build" "$T"
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^harvest' | sed 's/^/  image /' | tee -a "$SUMMARY"

# ---- 5. the demo model and a dataset of a few hundred rows, made by harvest in its image --------
T=$(now)
docker run --rm --network host -v "$WORK/models:/models" -v "$WORK/data:/data" --entrypoint python harvest:local -c \
  "from harvest.cli.demo import build_tiny_model, demo_rows, write_jsonl
build_tiny_model('/models/tiny'); write_jsonl('/data/ci.jsonl', demo_rows($ROWS))"
lap "tiny model + $ROWS rows" "$T"

# ---- 6. the operator's run ---------------------------------------------------------------------
worker_pids() {  # NAME=PID of each running worker container
  docker ps --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=worker" \
    --format '{{.Names}}' | while read -r c; do echo "$c=$(docker inspect -f '{{.State.Pid}}' "$c")"; done
}
busy_worker() {  # "container worker job" of one worker in the middle of a job, not in $1
  local i
  for i in $(seq 1 60); do
    # shellcheck disable=SC2046
    helper workers $(worker_pids) | "$PY" -c "
import json, sys
for w in json.load(sys.stdin):
    if w['state'] == 'busy' and w['job'] and w['container'] not in sys.argv[1:]:
        print(w['container'], w['worker'], w['job']); break
else:
    sys.exit(1)" ${1:-} && return 0
    sleep 0.5
  done
  return 1
}
ledger() { helper counts | "$PY" -c "import json,sys; c=json.load(sys.stdin); print($1)"; }
wait_for() {  # seconds, python expression over the ledger counts c, label
  local end=$(( $(date +%s) + $1 ))
  until [ "$(ledger "$2")" = True ]; do
    [ "$(date +%s)" -lt "$end" ] || die "timed out waiting for: $3 (ledger: $(helper counts))"
    sleep 1
  done
}
reaped() { helper reaped "$1"; }   # how often the janitor took this job back from a dead worker
job_outcome() {  # job id, worker that had it: wait until it is gone (finished), say who finished it
  local seen=""
  for _ in $(seq 1 240); do
    st=$(helper job "$1")
    case "$st" in
      *'"gone"'*) echo "finished${seen:+ (re-run by $seen)}"; return 0 ;;
      *'"started"'*) w=$(echo "$st" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["worker"])')
                     [ "$w" != "$2" ] && seen=$w ;;
    esac
    sleep 0.5
  done
  echo "not finished after 120 s: $st"
}

log "producer one-shot (starts redis, s3, s3-bucket)"
T=$(now)
dc --profile producer run --rm producer | tee "$WORK/produce.log"
lap "producer (run --rm, incl. redis+s3 up)" "$T"
samples=$(ledger 'c["total"]')

log "up --profile cpu --scale worker=3"
T=$(now)
dc --profile cpu up -d --scale worker=3
[ "$(docker network ls -q | wc -l)" = 2 ] || { docker network ls; die "a network was created"; }
wait_for 120 'c["spooled"] + c["done"] > 0' "the first samples spooled"
lap "up -> first samples spooled" "$T"
T_RUN=$(now)

log "scale to 1 worker mid-run (compose stops 2: SIGTERM, each finishes its job)"
before=$(helper workers $(worker_pids))
T=$(now)
dc --profile cpu up -d --no-recreate --scale worker=1
lap "scale worker=3 -> 1" "$T"
echo "$before" | "$PY" -c "
import json, sys; left = set(sys.argv[1:])
for w in json.load(sys.stdin):
    if w['container'] not in left and w['job']: print(w['job'], w['worker'])" $(worker_pids | cut -d= -f1) |
  while read -r j w; do note "  scaled-down worker $w: its job $j $(job_outcome "$j" "$w"), reaped $(reaped "$j") times"; done

log "scale back to 4"
T=$(now)
dc --profile cpu up -d --no-recreate --scale worker=4
lap "scale worker=1 -> 4" "$T"

log "stop of one worker (SIGTERM: it finishes its job, then exits)"
r=$(busy_worker) || die "no busy worker to stop"; read -r sc sw sj <<<"$r"
grace=$(dc config | "$PY" -c "import sys, yaml; print(yaml.safe_load(sys.stdin)['services']['worker']['stop_grace_period'])")
T=$(now)
docker stop -t 600 "$sc" >/dev/null   # what `docker compose stop` does to each of a service's containers
lap "stop of a busy worker (grace $grace)" "$T"
code=$(docker inspect -f '{{.State.ExitCode}}' "$sc")
note "  stopped $sc (worker $sw) exited $code; its job $sj: $(job_outcome "$sj" "$sw"), reaped $(reaped "$sj") times"
[ "$code" = 0 ] || die "the stopped worker exited $code"
[ "$(reaped "$sj")" = 0 ] || die "the stopped worker's job was reaped, not finished by it"

log "docker kill of a worker in the middle of a job"
r=$(busy_worker "$sc") || die "no busy worker to kill"; read -r kc kw kj <<<"$r"
reaped0=$(ledger 'c["stats"].get("jobs_reaped", 0)')
T_KILL=$(now)
docker kill "$kc" >/dev/null
note "  killed $kc (worker $kw) in the middle of job $kj"

log "restart of the collector"
T=$(now)
dc restart collector
lap "collector restart" "$T"

log "harvest status / requeue --dry-run through exec"
dc exec -T collector harvest status --run "$RUN_NAME" | tee "$WORK/status.txt"
dc exec -T collector harvest requeue --run "$RUN_NAME" --all --dry-run
log "metrics scrape"
curl -fsS http://127.0.0.1:16108/metrics > "$WORK/metrics.txt" || die "metrics endpoint did not answer"
grep -E '^harvest_samples' "$WORK/metrics.txt" | head -8
grep -q "run=\"$RUN_NAME\"" "$WORK/metrics.txt" || die "the metrics do not name run $RUN_NAME"
curl -fsS -o /dev/null http://127.0.0.1:16181/ || die "rq-dashboard did not answer"

log "the killed worker's job"
wait_for 90 "c['stats'].get('jobs_reaped', 0) > $reaped0" "the janitor to take back the killed worker's job"
lap "kill -> its job back on the queue" "$T_KILL"
by=$(for c in $(docker ps -a --filter "label=com.docker.compose.service=worker" --format '{{.Names}}'); do
       if docker logs "$c" 2>&1 | grep -q "job $kj back on the queue"; then echo "$c"; fi; done | head -1) || true
note "  killed worker's job $kj: reaped $(reaped "$kj") time(s), by the janitor of ${by:-?}; $(job_outcome "$kj" "$kw")"

log "wait for the run to finish"
wait_for 600 "c['queued'] == 0 and c['spooled'] == 0 and c['done'] + c['failed'] == $samples" "the run to finish"
lap "the run (first spooled -> all done)" "$T_RUN"
note "  ledger: $(helper counts)"

# ---- 7. the accounting, from the object store ----------------------------------------------------
log "verify from the object store (moto S3 on 127.0.0.1:16900)"
rep=$(HARVEST_S3_ENDPOINT=http://127.0.0.1:16900 AWS_ACCESS_KEY_ID=$S3_KEY AWS_SECRET_ACCESS_KEY=$S3_SECRET AWS_REGION=us-east-1 \
      helper verify "$WORK/models/tiny" "$WORK/data/ci.jsonl" "s3://harvest/hidden/$RUN_NAME") || { echo "$rep"; die "accounting"; }
note "  accounting: $rep"

# ---- 8. down -------------------------------------------------------------------------------------
log "down -v"
T=$(now)
dc --profile cpu --profile producer down -v -t 30
lap "down -v" "$T"
[ -z "$(docker ps -aq)" ] || die "containers left after down"
[ -z "$(docker volume ls -q)" ] || die "volumes left after down"
docker image prune -f >/dev/null   # dangling layers of superseded builds; the cache keeps the tagged ones
docker system df | sed 's/^/  /' | tee -a "$SUMMARY"
note "  disk: data root $(du -sh -x "$DATA_ROOT" | cut -f1) $([ "${COMPOSE_CI_FRESH:-0}" = 1 ] && echo "(removed: COMPOSE_CI_FRESH=1)" || echo "(kept in $CACHE)"), base tar $(du -sh "$BASE_TAR" | cut -f1)"
lap "total" "$T0"
note "compose-ci: OK"
