"""Shadow drafting through the server: the candidate's numbers in GetStats (gRPC) and in
/metrics (HTTP), labelled with the candidate; replies unchanged; `engine serve` refusing a
candidate it cannot shadow."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import save_tiny

from serving_helpers import client_for, make_engine, openai_client, reference, wait_for

from specpair.contract import content_hash
from specpair.shadow import attach_shadow


def write_release(path, target: str, version: str = "9") -> dict:
    release = {"target": {"source": target}, "draft": {"drafter": "ngram"}, "speculation": {"k": 3},
               "mlflow": {"version": version}}
    path.write_text(json.dumps(release))
    return release


def shadow_samples(server, category: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("specpair_shadow_") and s.labels.get("category") == category
            and s.labels.get("candidate_version") == "9"}


def test_shadow_numbers_in_get_stats_and_metrics(tiny_pair, start_server, tmp_path):
    from specpair.costs import RequestAudit

    target, _draft = tiny_pair
    engine = make_engine(tiny_pair)
    engine.audit = RequestAudit(1.0)    # the champion's sums below are GetStats', its audited requests'
    release = write_release(tmp_path / "candidate.json", target.source)
    scorer = attach_shadow(engine, tmp_path / "candidate.json", share=1.0,
                           serving_target=(target.source, None), seed=0)
    server = start_server(engine, http_port=0)
    prompts = ["def parse(self, text):\n    return self.parse(text)\n", "import os\nimport sys\nimport",
               "hello world hello world hello"]
    with client_for(server) as client:
        for prompt in prompts:
            reply = client.generate(prompt, max_new_tokens=16, category="code")
            assert reply.token_ids == reference(tiny_pair, prompt, 16).token_ids   # the reply is untouched
        http = openai_client(server).completions.create(
            model="tiny", prompt=prompts[0], max_tokens=16, temperature=0.8, seed=5,
            extra_body={"specpair": {"category": "chat"}})
        assert http.choices[0].text
        stats = client.stats()
    shadow = stats.shadow
    assert (shadow.candidate_version, shadow.candidate_content_hash, shadow.share) == \
        ("9", content_hash(release), 1.0)
    code, chat = shadow.categories["code"], shadow.categories["chat"]
    assert (code.requests, chat.requests) == (3, 1)
    counted = scorer.snapshot()
    assert code.candidate_alpha.positions == counted["code"].candidate_alpha.drafted > 0
    assert code.candidate_alpha.alpha == pytest.approx(counted["code"].candidate_alpha.accepted)
    assert code.candidate_chain.draft_tokens == counted["code"].candidate_chain.drafted > 0
    assert code.champion_chain.draft_tokens == stats.categories["code"].finished.draft_tokens
    assert code.committed_tokens == 3 * 16 and code.draft_seconds > 0
    assert code.alpha_paired.requests == code.chain_paired.requests == 3
    assert chat.candidate_chain.requests == 0 and chat.committed_tokens == 16   # sampled: alpha only

    def exported():
        samples = shadow_samples(server, "code")
        return samples if samples.get("specpair_shadow_requests_total") == 3 else None
    samples = wait_for(exported, timeout=60)
    assert samples["specpair_shadow_num_draft_positions_total"] == code.candidate_alpha.positions
    assert samples["specpair_shadow_alpha_sum_total"] == pytest.approx(code.candidate_alpha.alpha)
    assert samples["specpair_shadow_num_draft_tokens_total"] == code.candidate_chain.draft_tokens
    assert samples["specpair_shadow_num_accepted_tokens_total"] == code.candidate_chain.accepted_tokens
    assert samples["specpair_shadow_num_committed_tokens_total"] == 48
    assert samples["specpair_shadow_draft_seconds_total"] == pytest.approx(code.draft_seconds)
    assert wait_for(lambda: shadow_samples(server, "chat").get("specpair_shadow_requests_total") == 1)


def test_no_shadow_no_shadow_stats(shared_server, client):
    assert not client.stats().HasField("shadow")


@pytest.mark.slow
def test_serve_refuses_a_candidate_it_cannot_shadow(tiny_pair, tmp_path):
    target, _draft = tiny_pair
    target_dir = save_tiny(target, tmp_path / "target")
    write_release(tmp_path / "other.json", "another/target")
    serve = [sys.executable, "-m", "specpair.server", "engine", "serve", "--insecure", "--host", "127.0.0.1",
             "--port", "0", "--metrics-port", "-1", "--device", "cpu", "--target", target_dir]
    other = subprocess.run(serve + ["--shadow-release", str(tmp_path / "other.json")], capture_output=True,
                           text=True, timeout=180)
    assert other.returncode == 2
    assert "must share the serving target" in other.stderr and "Traceback" not in other.stderr
    missing = subprocess.run(serve + ["--shadow-release", str(tmp_path / "missing.json")], capture_output=True,
                             text=True, timeout=180)
    assert missing.returncode == 2
    assert "--shadow-release" in missing.stderr and "missing.json" in missing.stderr
    share = subprocess.run(serve + ["--shadow-share", "1.5"], capture_output=True, text=True, timeout=60)
    assert share.returncode == 2 and "--shadow-share: must be in [0, 1]" in share.stderr
