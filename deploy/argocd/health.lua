-- Argo CD health check for specpair.io/SpecModelPair.
-- Installed as argocd-cm `resource.customizations.health.specpair.io_SpecModelPair` by the
-- kustomize component in this folder, or with the Argo CD Helm chart's --set-file (see
-- docs/install.md). Argo CD runs it with the live object as the global `obj` (gopher-lua, Lua 5.1
-- syntax only) and reads back {status, message}.
--
-- The operator follows kstatus: conditions Ready / Reconciling / Stalled, written together and
-- each stamped with the generation it describes, plus Gated, TokenizerCompatible and Drifted.
-- The reasons branched on are ones the operator writes (tests/ship/test_ship_argocd_health.py
-- builds its cases with the operator's own status ledger and checks each reason here is one):
--   Stalled=True (any reason: a failed gate, a rejected shadow or aborted canary, a release
--   rolled back, no previous release to roll back to, an invalid spec, ...),
--   Gated=False, TokenizerCompatible=False,
--   Reconciling=True for a rollback (RolledBack)          -> Degraded (the spec in Git did not land)
--   not yet observed, Reconciling=True, Ready not True    -> Progressing
--   Ready=True for the current generation                 -> Healthy

local function conditionOf(conditions, conditionType)
  if conditions == nil then
    return nil
  end
  for _, condition in ipairs(conditions) do
    if condition.type == conditionType then
      return condition
    end
  end
  return nil
end

local function describe(condition, fallback)
  if condition == nil then
    return fallback
  end
  local text = condition.reason or condition.type
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

local function healthOf(object)
  local status = object.status
  if status == nil or status.conditions == nil then
    return "Progressing", "Waiting for the specpair operator to reconcile this pair"
  end

  local generation = object.metadata and object.metadata.generation
  local observed = status.observedGeneration
  local ready = conditionOf(status.conditions, "Ready")
  if observed == nil and ready ~= nil then
    observed = ready.observedGeneration
  end
  if generation ~= nil and observed ~= nil and observed < generation then
    return "Progressing", "Waiting for the operator to observe generation " .. tostring(generation)
      .. " (status is for " .. tostring(observed) .. ")"
  end

  local stalled = conditionOf(status.conditions, "Stalled")
  if stalled ~= nil and stalled.status == "True" then
    return "Degraded", describe(stalled, "Stalled")
  end
  local tokenizer = conditionOf(status.conditions, "TokenizerCompatible")
  if tokenizer ~= nil and tokenizer.status == "False" then
    return "Degraded", "Tokenizers differ: " .. describe(tokenizer, "")
  end
  local gated = conditionOf(status.conditions, "Gated")
  if gated ~= nil and gated.status == "False" then
    return "Degraded", "Gate failed: " .. describe(gated, "")
  end
  local reconciling = conditionOf(status.conditions, "Reconciling")
  -- A rollback undoes the spec's release (its pods never became available, or it drifted): the
  -- previous release comes back, and what Git asks for will not serve until the spec changes.
  if reconciling ~= nil and reconciling.status == "True" and reconciling.reason == "RolledBack" then
    return "Degraded", "Rolled back: " .. describe(reconciling, "")
  end
  if reconciling ~= nil and reconciling.status == "True" then
    return "Progressing", describe(reconciling, "Reconciling")
  end

  if ready ~= nil and ready.status == "True" then
    local message = describe(ready, "Ready")
    if status.servingVersion ~= nil then
      message = "Serving release " .. tostring(status.servingVersion) .. " (" .. message .. ")"
    end
    local drifted = conditionOf(status.conditions, "Drifted")
    if drifted ~= nil and drifted.status == "True" then
      message = message .. "; drift: " .. describe(drifted, "Drifted")
    end
    return "Healthy", message
  end
  return "Progressing", describe(ready, "Waiting for the Ready condition")
end

local hs = {}
hs.status, hs.message = healthOf(obj)
return hs
