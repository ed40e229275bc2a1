"""Per pair, was its engine asked by the operator in every drift interval (30 s) of the window?
From the operator's TCP connections (ss -tinp: data segments sent per connection; the operator
keeps one gRPC channel per engine pod, and its only traffic to a pod is its calls: GetStats each
pass, GetModelInfo on full passes; the node agents' probes come from another process), mapped to
pods by podIP. Waits for the bench's "restart (steady)" line, then its --settle, then snapshots
every 30 s for the window. A record of the 2026-12-07g runs, not a tool the project calls:

    judged.py BENCH_PID BENCH_LOG KUBECONFIG SETTLE_S INTERVALS OUT.json   (kubectl on PATH)"""
import json, re, subprocess, sys, time
from collections import defaultdict
OP_MARK, LOG, KUBECONFIG, SETTLE, WINDOWS, OUT = sys.argv[1:7]
SETTLE, WINDOWS = float(SETTLE), int(WINDOWS)

def operator_pid():
    # The bench's child running kopf (OP_MARK is the bench's pid): not this process, whose own
    # command line would match a pattern.
    out = subprocess.run(["pgrep", "-P", OP_MARK, "-f", "kopf"], capture_output=True, text=True).stdout.split()
    return int(out[0])

def snapshot(pid):
    text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True).stdout
    lines = text.splitlines()
    conns = {}
    for i, line in enumerate(lines):
        if f"pid={pid}," not in line:
            continue
        parts = line.split()
        local, peer = parts[2], parts[3]
        info = lines[i + 1] if i + 1 < len(lines) else ""
        m = re.search(r"data_segs_out:(\d+)", info)
        conns[(local, peer)] = int(m.group(1)) if m else 0
    return conns

while True:
    if re.search(r"restart \(steady\)", open(LOG).read()):
        break
    time.sleep(2)
t0 = time.time()
pods = json.loads(subprocess.run(["kubectl", "--kubeconfig", KUBECONFIG, "get", "pods", "-A", "-o", "json"],
                                 capture_output=True, text=True, timeout=300).stdout)["items"]
pairs = json.loads(subprocess.run(["kubectl", "--kubeconfig", KUBECONFIG, "get", "specmodelpairs", "-A", "-o", "json"],
                                  capture_output=True, text=True, timeout=300).stdout)["items"]
serving = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pairs
           if (p.get("status") or {}).get("phase") == "Serving"}
by_ip = {}
for p in pods:
    ip = (p.get("status") or {}).get("podIP")
    pair = (p["metadata"].get("labels") or {}).get("specpair.io/pair")
    if ip and pair and (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"):
        by_ip.setdefault(ip, []).append((p["metadata"]["namespace"], pair, p["metadata"]["name"]))
time.sleep(max(0.0, SETTLE - (time.time() - t0)))
pid = operator_pid()
snaps = [(time.time(), snapshot(pid))]
for _ in range(WINDOWS):
    time.sleep(30 - (time.time() - snaps[-1][0]))
    snaps.append((time.time(), snapshot(pid)))
asked = []   # per interval: pairs whose engine pod got data from the operator
for (ta, a), (tb, b) in zip(snaps, snaps[1:]):
    got = set()
    for key, segs in b.items():
        if segs > a.get(key, 0):
            for ns, pair, _ in by_ip.get(key[1].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:"), []):
                got.add((ns, pair))
    asked.append(got)
every = set.intersection(*asked) if asked else set()
result = {"intervals": len(asked), "intervalSeconds": [round(tb - ta, 1) for (ta, _), (tb, _) in zip(snaps, snaps[1:])],
          "servingPairs": len(serving),
          "servingAskedEachInterval": [len(serving & g) for g in asked],
          "servingAskedInEveryInterval": len(serving & every),
          "servingNeverAsked": sorted(f"{ns}/{n}" for ns, n in serving - set().union(*asked))[:20],
          "servingMissedSomeInterval": sorted(f"{ns}/{n}" for ns, n in serving - every)[:20],
          "operatorConnections": [len(s) for _, s in snaps], "enginePodIPs": len(by_ip),
          "started": time.strftime("%H:%M:%S", time.gmtime(snaps[0][0]))}
result["askedEachIntervalAnyPair"] = [len(g) for g in asked]
json.dump({"snapshots": [[t, [[k[0], k[1], v] for k, v in snap.items()]] for t, snap in snaps],
           "byIp": by_ip, "serving": sorted(map(list, serving))}, open(OUT + ".raw", "w"))
open(OUT, "w").write(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
