#!/usr/bin/env sh
# Launch a volunteer training peer. Usage: peer/run.sh <bootstrap multiaddr> [extra p2ptrain peer flags]
# The bootstrap multiaddr is what `p2ptrain bootstrap` printed (it ends in /p2p/<peer id>).
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 /ip4/<host>/tcp/<port>/p2p/<peer id> [p2ptrain peer flags...]" >&2
    exit 2
fi
here=$(dirname "$0")
initial_peer=$1
shift
exec p2ptrain peer --config "$here/config.yaml" --initial-peers "$initial_peer" \
    --identity "${P2PTRAIN_IDENTITY:-$HOME/.p2ptrain/peer.key}" "$@"
