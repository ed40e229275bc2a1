"""The judgments plans apply, as pure functions over evidence: drift, serving health, the shadow
verdict, the canary's comparison, the rollout strategy. No I/O."""
