"""The gate's sweeps for the tests' pairs that serve the spec's own k and batch threshold
(rollout.applyGateTuning: false). A module, not conftest, so any test folder can import it."""

# gating.tuning with both sweeps skipped: such a pair's tuning would be measured for nothing
# (the k and batch-size sweeps were 58% of a real gate's CPU on the tiny models, py-spy over the
# demo's gates).
NO_SWEEPS = {"kValues": [], "batchSizes": []}
