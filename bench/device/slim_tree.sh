#!/usr/bin/env bash
# The device call carries the working tree with .carry and .devdata, 64 MiB in all; since the
# forty-fourth session the tracked results (bench/results/, 21.6 MB) take the three past it.
# `bash bench/device/slim_tree.sh out` moves the largest folders no device command reads (the
# plots, two old H200 result folders) to /tmp/rimuru_slim before a call; `... back` returns them.
# The working tree only: git sees the files as deleted between the two, never commits them.
set -euo pipefail
cd "$(dirname "$0")/../.."
stash=/tmp/rimuru_slim
dirs=(bench/results/plots bench/results/device_h200_2026-12-04b bench/results/device_h200_2026-12-04c)
case "${1:-}" in
  out)
    mkdir -p "$stash"
    for d in "${dirs[@]}"; do
      [ -e "$d" ] && mkdir -p "$stash/$(dirname "$d")" && mv "$d" "$stash/$d"
    done
    echo "slim_tree: moved to $stash; the tree without .git: $(du -sk --exclude=.git . | cut -f1) KiB" ;;
  back)
    for d in "${dirs[@]}"; do
      [ -e "$stash/$d" ] && mv "$stash/$d" "$d"
    done
    git status --short -- bench/results | head -3
    echo "slim_tree: back" ;;
  *) echo "usage: bash bench/device/slim_tree.sh out|back" >&2; exit 2 ;;
esac
