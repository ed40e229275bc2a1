"""The demo's chapters, one module each, in the order run_demo.py tells them:

1. start: the control plane, MLflow and the operator from its helm chart;
2-4. releases: v1 applied, gated, promoted and served, its answers streamed; v2 shipped;
5. traffic_shift: a category no gate measured, counted and left alone;
6. drift: a domain shift (n-gram) or a bad draft (a draft model), up the drift ladder;
7. shadow: a draft-side candidate scored on the champion's pods (demo/shadow_chapter.py's pieces).

Each is a function of the run's Session (demo/session.py); the pieces without a cluster live in
demo/ladder.py and demo/shadow_chapter.py, where tests read them."""
