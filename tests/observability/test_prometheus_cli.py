"""`python -m specpair_devcluster prometheus` (scripts/devcluster.sh prometheus): a real Prometheus
for people, against a running devcluster, with the jobs of the chart's monitors and the chart's
alert rules loaded (what it scrapes is proven in test_prometheus_live.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from obs_helpers import alert_rules


def test_prometheus_command_runs_the_charts_jobs_and_rules(devcluster, prometheus_bin):
    from specpair_devcluster.processes import free_port

    devcluster.write_state()  # what `up` leaves for the other commands: this session's cluster
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specpair_devcluster", "prometheus", "--dir", str(devcluster.workdir),
                             "--release", "people", "--namespace", "specpair-system", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SPECPAIR_PROMETHEUS_BIN": str(prometheus_bin)})
    try:
        seen = []
        while not (seen and seen[-1].startswith("Prometheus ")) and (line := proc.stdout.readline()):
            seen.append(line)
        assert seen and seen[-1].startswith(f"Prometheus http://127.0.0.1:{port} "), "".join(seen)
        line = seen[-1]
        # The jobs are the monitors the chart renders for that release.
        assert "podMonitor/specpair-system/people-specpair-operator/0" in line
        assert "serviceMonitor/specpair-system/people-specpair-engines/0" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as r:
            rules = [r for g in json.load(r)["data"]["groups"] for r in g["rules"]]
        assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0
