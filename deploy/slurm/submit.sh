#!/bin/bash
# Submit a harvest run to SLURM: the head job (Redis, producer, metrics), then NODES node jobs as
# one array that may start once the head has started (--dependency=after:HEAD).
#
#   export HARVEST_RUN=my-run HARVEST_SHARED=/shared/harvest/my-run \
#          HARVEST_DATASET=/shared/data/train.jsonl HARVEST_MODEL=/shared/models/M \
#          HARVEST_OUT=s3://bucket/hidden HARVEST_NODE_ARGS="--engine sglang --model /shared/models/M --tp 8"
#   deploy/slurm/submit.sh 4 --gres=gpu:8 --exclusive --time=12:00:00
#
# Arguments after NODES go to the node jobs' sbatch; HARVEST_HEAD_SBATCH_ARGS (a word list) to the
# head's (e.g. "--time=2-00:00:00 --partition=cpu"). The jobs' logs are slurm-<head>.out and
# slurm-<array>_<task>.out in the folder you submit from. Prints: head=<id> nodes=<array id>.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NODES [sbatch options for the node jobs...]" >&2
  exit 2
fi
nodes=$1
shift
: "${HARVEST_RUN:?set HARVEST_RUN}" "${HARVEST_SHARED:?set HARVEST_SHARED (a folder every node mounts)}"
: "${HARVEST_DATASET:?set HARVEST_DATASET}" "${HARVEST_MODEL:?set HARVEST_MODEL}" "${HARVEST_OUT:?set HARVEST_OUT}"
mkdir -p "$HARVEST_SHARED"

# shellcheck disable=SC2086  # a word list
head=$(sbatch --parsable --job-name="harvest-head-$HARVEST_RUN" ${HARVEST_HEAD_SBATCH_ARGS:-} "$here/head.sbatch")
head=${head%%;*}
array=$(sbatch --parsable --job-name="harvest-node-$HARVEST_RUN" --dependency="after:$head" \
  --array="0-$((nodes - 1))" "$@" "$here/node.sbatch")
array=${array%%;*}
echo "head=$head nodes=$array"
