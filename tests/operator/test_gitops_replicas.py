"""Git and the autoscaler on one pair, on the real API server with the real kubectl
(docs/install.md, "GitOps"): the autoscaler writes spec.rollout.replicas through the scale
subresource; a manifest in Git that leaves `replicas` out is applied again (a new commit changes
the draft) the way Flux applies it (server-side apply, field manager kustomize-controller, conflicts
forced) and the way Argo CD does by default (client-side apply), and the replicas the autoscaler
set stay while the change lands. A manifest that names `replicas` takes them back each time:
the fight the docs say to avoid.
"""

from __future__ import annotations

import json
import uuid

import pytest

from cluster_env import kubectl, pair


def _replicas_and_draft(ns, name: str) -> tuple[int, str]:
    spec = ns.pair(name)["spec"]
    return spec["rollout"].get("replicas"), spec["draft"]["source"]


FLUX = ("apply", "--server-side", "--field-manager=kustomize-controller", "--force-conflicts", "-f", "-")
ARGO_CD = ("apply", "-f", "-")


@pytest.mark.parametrize("apply", [FLUX, ARGO_CD], ids=["flux-server-side", "argocd-client-side"])
def test_a_manifest_without_replicas_keeps_the_autoscalers_and_one_with_them_fights(operator_env, ns, apply):
    name = f"git-{uuid.uuid4().hex[:5]}"
    manifest = pair(name, "good-draft")
    manifest["metadata"]["namespace"] = ns.name
    manifest["spec"]["rollout"].pop("replicas", None)
    done = kubectl(ns.cluster, *apply, input=json.dumps(manifest))
    assert done.returncode == 0, done.stderr

    scaled = kubectl(ns.cluster, "-n", ns.name, "scale", f"specmodelpair/{name}", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    assert _replicas_and_draft(ns, name) == (3, "good-draft")

    manifest["spec"]["draft"]["source"] = "better-draft"    # the next commit
    done = kubectl(ns.cluster, *apply, input=json.dumps(manifest))
    assert done.returncode == 0, done.stderr
    assert _replicas_and_draft(ns, name) == (3, "better-draft")

    manifest["spec"]["rollout"]["replicas"] = 1                # Git names replicas: it takes them back
    done = kubectl(ns.cluster, *apply, input=json.dumps(manifest))
    assert done.returncode == 0, done.stderr
    assert _replicas_and_draft(ns, name) == (1, "better-draft")
