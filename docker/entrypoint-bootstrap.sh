#!/bin/sh
# Entrypoint of the p2ptrain bootstrap image: `exec p2ptrain bootstrap` with a persistent identity (a stable peer
# id across restarts) and, if P2PTRAIN_ADDRESS_FILE is set, its multiaddrs written there for the peers to read.
# Every variable read here is described in docker/README.md.
set -eu
set -f

num_user_args=$#
set -- "$@" --identity "${P2PTRAIN_IDENTITY:-/data/identity.key}"
for maddr in $(echo "${P2PTRAIN_HOST_MADDRS:-/ip4/0.0.0.0/tcp/31337}" | tr ',' ' '); do
    set -- "$@" --host-maddrs "$maddr"
done
for maddr in $(echo "${P2PTRAIN_ANNOUNCE_MADDRS:-}" | tr ',' ' '); do
    set -- "$@" --announce-maddrs "$maddr"
done
if [ -n "${P2PTRAIN_ADDRESS_FILE:-}" ]; then
    rm -f "$P2PTRAIN_ADDRESS_FILE"  # a stale file from the last run could name an old container address
    set -- "$@" --address-file "$P2PTRAIN_ADDRESS_FILE"
fi
[ -n "${P2PTRAIN_RUN_ID:-}" ] && set -- "$@" --run-id "$P2PTRAIN_RUN_ID"
set -- "$@" --no-nat-port-map
i=0
while [ "$i" -lt "$num_user_args" ]; do
    set -- "$@" "$1"
    shift
    i=$((i + 1))
done
exec p2ptrain bootstrap "$@"
