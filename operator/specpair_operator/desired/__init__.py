"""The objects the operator wants to exist, as pure functions of the pair and its release:
engine Deployment and Service, model-fetch Job, autoscaler, certificates."""
