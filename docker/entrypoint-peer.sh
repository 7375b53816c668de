#!/bin/sh
# Entrypoint of the p2ptrain peer image: optionally shape this container's upload, find the bootstrap, then
# `exec p2ptrain peer` (or the testnet's red team) with flags built from P2PTRAIN_* variables, followed by the
# container's own arguments.
# Every variable read here is described in docker/README.md.
set -eu
set -f  # multiaddr lists are split on spaces and commas below; never glob them

say() { echo "entrypoint-peer: $*" >&2; }

if [ -n "${P2PTRAIN_RATE_MBIT:-}" ]; then
    dev=${P2PTRAIN_SHAPE_DEV:-eth0}
    case $P2PTRAIN_RATE_MBIT in
        *[!0-9.]* | *.*.* | .* | *.) say "P2PTRAIN_RATE_MBIT=$P2PTRAIN_RATE_MBIT is not a number of Mbit/s"; exit 2 ;;
    esac
    # Same tbf sizing as p2ptrain.testnet.netns.tbf_args: burst = max(rate/250, 16 KiB), queue = 50 ms at the rate.
    tbf=$(awk -v r="$P2PTRAIN_RATE_MBIT" 'BEGIN {
        bytes_per_s = r * 1e6 / 8; burst = bytes_per_s / 250; if (burst < 16384) burst = 16384
        printf "rate %.0fbit burst %.0f limit %.0f", r * 1e6, burst, burst + bytes_per_s * 0.05 }')
    # shellcheck disable=SC2086  # $tbf is a list of tc arguments
    if ! tc_error=$(tc qdisc replace dev "$dev" root tbf $tbf 2>&1); then
        say "cannot shape $dev to $P2PTRAIN_RATE_MBIT Mbit/s (run with --cap-add NET_ADMIN): $(echo "$tc_error" | head -n 1)"
        exit 2
    fi
    say "upload on $dev shaped to $P2PTRAIN_RATE_MBIT Mbit/s"
fi

initial_peers=${P2PTRAIN_INITIAL_PEERS:-}
if [ -z "$initial_peers" ] && [ -n "${P2PTRAIN_BOOTSTRAP_ADDRESS_FILE:-}" ]; then
    address_file=$P2PTRAIN_BOOTSTRAP_ADDRESS_FILE
    wait_s=${P2PTRAIN_BOOTSTRAP_WAIT_S:-120}
    waited_s=0
    while [ ! -s "$address_file" ]; do  # the bootstrap writes it atomically once it listens
        if [ "$waited_s" -ge "$wait_s" ]; then
            say "no bootstrap address in $address_file after ${wait_s} s: is the bootstrap service running?"
            exit 2
        fi
        sleep 1
        waited_s=$((waited_s + 1))
    done
    # Loopback addresses in the file are the bootstrap container's own; they do not reach it from here.
    initial_peers=$(grep -v -e '/ip4/127\.' -e '/ip6/::1/' "$address_file" | tr '\n' ' ')
fi

# Append our flags after the container's arguments, then rotate those arguments to the end (a flag given there
# again, e.g. --checkpoint-dir, wins: the last one counts).
num_user_args=$#
# Identity and checkpoints live in /data, a volume per peer in docker-compose.yml: a restarted container comes back
# with the same peer id and resumes from its latest checkpoint. An empty variable turns the flag off.
identity=${P2PTRAIN_IDENTITY-/data/identity.key}
checkpoint_dir=${P2PTRAIN_CHECKPOINT_DIR-/data/checkpoints}
[ -n "$identity" ] && set -- "$@" --identity "$identity"
if [ -n "$checkpoint_dir" ]; then
    set -- "$@" --checkpoint-dir "$checkpoint_dir"
    if [ -s "$checkpoint_dir/latest" ]; then
        say "resuming from the latest checkpoint in $checkpoint_dir"
        set -- "$@" --resume
    fi
fi
for maddr in $(echo "$initial_peers" | tr ',' ' '); do
    set -- "$@" --initial-peers "$maddr"
done
[ -n "${P2PTRAIN_RUN_ID:-}" ] && set -- "$@" --run-id "$P2PTRAIN_RUN_ID"
[ -n "${P2PTRAIN_CONFIG:-}" ] && set -- "$@" --config "$P2PTRAIN_CONFIG"
[ -n "${P2PTRAIN_DEVICE:-}" ] && set -- "$@" --device "$P2PTRAIN_DEVICE"
for maddr in $(echo "${P2PTRAIN_HOST_MADDRS:-}" | tr ',' ' '); do
    set -- "$@" --host-maddrs "$maddr"
done
for maddr in $(echo "${P2PTRAIN_ANNOUNCE_MADDRS:-}" | tr ',' ' '); do
    set -- "$@" --announce-maddrs "$maddr"
done
[ "${P2PTRAIN_NAT_PORT_MAP:-0}" = 1 ] || set -- "$@" --no-nat-port-map  # no UPnP router inside Docker
i=0
while [ "$i" -lt "$num_user_args" ]; do
    set -- "$@" "$1"
    shift
    i=$((i + 1))
done
if [ "${P2PTRAIN_RED_TEAM:-0}" = 1 ]; then  # testnets only: a hostile peer (its --attack is among the arguments)
    exec python -m p2ptrain.testnet.red_team "$@"
fi
exec p2ptrain peer "$@"
