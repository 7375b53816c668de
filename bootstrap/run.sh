#!/usr/bin/env sh
# Start the bootstrap node of a run. Its identity key makes the printed multiaddr stable across restarts:
# hand that address to every volunteer (peer/run.sh <address>). Usage: bootstrap/run.sh [port] [extra flags]
set -eu
port=${1:-31337}
[ $# -gt 0 ] && shift
exec p2ptrain bootstrap --identity "${P2PTRAIN_IDENTITY:-$HOME/.p2ptrain/bootstrap.key}" \
    --host-maddrs "/ip4/0.0.0.0/tcp/$port" --address-file "${P2PTRAIN_ADDRESS_FILE:-bootstrap.addr}" "$@"
