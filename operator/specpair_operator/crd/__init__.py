"""The contract of a SpecModelPair: its CRD schema, the operator's own check of a spec against it,
the names derived from a pair and the status conditions it reports. Imports no other stage."""
