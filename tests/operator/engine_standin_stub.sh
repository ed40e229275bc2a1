#!/bin/sh
# `specpair` in the hosted stand-in image (engine_standin_host.py): the pod's whole process is this
# shell, a megabyte where a stand-in engine of its own is ~35 MB. It hands its command line to the
# host process, which serves the pod's addresses, and waits; on SIGTERM it takes the line back
# (the host stops serving), and a stub killed outright is noticed by the host (its pid is gone).
spool="${SPECPAIR_STANDIN_SPOOL:?SPECPAIR_STANDIN_SPOOL names the host process's spool folder}"
file="$spool/$$.args"
printf '%s\0' "$@" > "$file.tmp" && mv "$file.tmp" "$file" || exit 1
trap 'kill "$waiting" 2>/dev/null; rm -f "$file"; exit 0' TERM INT
while :; do
  sleep 3600 &
  waiting=$!
  wait "$waiting"
done
