#!/bin/bash
# An emulated drive that reads and writes at once (a "duplex" drive, as NVMe drives are), for
# measuring io.background_depth and the step's I/O order on a machine whose own disk serves one
# direction at a time (this project's VMs): ext4 on a loop device over a file in RAM, each
# direction throttled apart by the cgroup-v1 blkio controller, so reads and writes never slow
# each other. Needs root, /dev/shm with room for the file, and /sys/fs/cgroup/blkio.
#
#   sudo benchmarks/duplex_drive.sh up [GBPS_EACH_WAY] [SIZE]   # default 0.4 GB/s, 8G
#   sudo benchmarks/duplex_drive.sh down
#
# `up` mounts the drive at /mnt/duplex (swap directory /mnt/duplex/swap) and moves the calling
# shell's parent into the throttled cgroup, so later commands of that session are throttled on
# it, e.g.
#   python benchmarks/bench_step.py --runs cpu/nvme --batch 1 --seq 32 --nvme-path /mnt/duplex/swap \
#       --io threads=8,queue_depth=16,background_depth=2
# (RESULTS.md, "The write-back beside the reads": 0.4 GB/s each way). Throttling applies to
# direct I/O (the swap store's O_DIRECT); `offload bench-io --path /mnt/duplex/swap` shows the
# overlap (about 1.9x).
set -euo pipefail
IMAGE=/dev/shm/offload-duplex.img
MOUNT=/mnt/duplex
CGROUP=/sys/fs/cgroup/blkio/offload-duplex

case "${1:-}" in
  up)
    gbps="${2:-0.4}"
    size="${3:-8G}"
    bps=$(python3 -c "print(int(float('$gbps') * 1e9))")
    truncate -s "$size" "$IMAGE"
    loop=$(losetup -f --show "$IMAGE")
    mkfs.ext4 -q "$loop"
    mkdir -p "$MOUNT"
    mount "$loop" "$MOUNT"
    mkdir -p "$MOUNT/swap"
    devno=$(cat "/sys/block/$(basename "$loop")/dev")
    mkdir -p "$CGROUP"
    echo "$devno $bps" > "$CGROUP/blkio.throttle.read_bps_device"
    echo "$devno $bps" > "$CGROUP/blkio.throttle.write_bps_device"
    echo "$PPID" > "$CGROUP/cgroup.procs"
    echo "duplex drive $loop ($devno) at $MOUNT, $gbps GB/s each way; swap directory $MOUNT/swap"
    ;;
  down)
    loop=$(findmnt -n -o SOURCE "$MOUNT" 2>/dev/null || true)
    if [ -n "$loop" ]; then umount "$MOUNT"; losetup -d "$loop"; fi
    rm -f "$IMAGE"
    echo "duplex drive removed"
    ;;
  *)
    echo "usage: $0 up [GBPS_EACH_WAY] [SIZE] | down" >&2
    exit 2
    ;;
esac
