#!/usr/bin/env python
"""Controlled probes of what lifts an EAGLE head's first draft on requests it never saw.

    python bench/head_probe.py --target TARGET_DIR --replies OUT/replies.jsonl \
        --heldout HELDOUT/replies.jsonl --out RESULT.json [--steps 600] \
        [--variant NAME:KEY=VALUE,...]...

Every variant trains a head on exactly the same data (the stdlib corpus of `distill
--corpus-chars`, seed 0, plus the conversations in --replies), the same windows and the same
seed, as `specpair distill --method eagle` does (its head, loss, optimiser and schedule), and
differs in one thing:
  - `aux=2+15`: EAGLE-3's feature fusion. fc also reads the outputs of these target layers
    (each RMS-normalised, without a weight), beside the target's last feature; it starts at zero
    on them, so step 0 is the plain head;
  - `noise=0.3`: the uniform noise on the input features (relative to their RMS; distill: 0.1);
  - `wd=0.1`: AdamW's weight decay (distill: 0.01);
  - `freeze=model.layers.0.mlp`: parameters (by name prefix) left at their start;
  - `steps=1200`: more steps than --steps (the schedule stretched to them).
Features are computed once, by one target pass, for every variant alike. Each head is then
measured teacher-forced, as `bench/head_agreement.py` does at depth 1: how often its first
draft is the target's own token, on every 10th training conversation, on --heldout (distill's
replies.jsonl for other requests, e.g. another seed), on its QA and code part, and on the
target's replies to the bench's prompts. An EAGLE head's first draft decides everything after
it: a chain that dies there never reaches the later steps.

Figures: docs/measurements/cpu_eagle_probes_400.json; read in docs/bench/heads.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

KNOBS = {"aux": "", "noise": None, "wd": 0.01, "freeze": "", "steps": None}


def parse_variant(text: str) -> tuple[str, dict]:
    """"NAME:key=value,key=value" -> (NAME, settings); "base" alone is the plain head."""
    name, _, rest = text.partition(":")
    settings = dict(KNOBS)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in KNOBS or not eq:
            raise ValueError(f"variant {text!r}: unknown setting {item!r} (known: {', '.join(KNOBS)})")
        settings[key] = value
    settings["aux"] = [int(a) for a in settings["aux"].split("+")] if settings["aux"] else []
    settings["wd"] = float(settings["wd"])
    if settings["noise"] is not None:
        settings["noise"] = float(settings["noise"])
    if settings["steps"] is not None:
        settings["steps"] = int(settings["steps"])
    return name, settings


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FeatureReader:
    """The target's last feature and, for fusion, the RMS-normalised outputs of some layers."""

    def __init__(self, target, layers: list[int]):
        self.target, self.layers, self.seen = target, sorted(set(layers)), {}
        blocks = target.model.model.layers
        for i in self.layers:
            if not 0 <= i < len(blocks):
                raise ValueError(f"layer {i}: the target has {len(blocks)}")
        self.hooks = [blocks[i].register_forward_hook(
            lambda _m, _i, out, i=i: self.seen.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in self.layers]

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> torch.Tensor:
        """[n] -> [n, (1 + len(layers)) * D]: the last feature first, then the layers in order."""
        last = self.target.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.cat([last] + [rms(self.seen[i][0]) for i in self.layers], dim=-1)


def columns(reader: FeatureReader, aux: list[int], D: int) -> torch.Tensor:
    """Which columns of the reader's features a head with these aux layers reads."""
    cols = list(range(D))
    for i in aux:
        k = 1 + reader.layers.index(i)
        cols += list(range(k * D, (k + 1) * D))
    return torch.tensor(cols)


def fused_head(base, aux_count: int):
    """The distill head, with fc widened to [embedding, feature, aux...]; zero on the aux part."""
    from torch import nn

    D = base.config.hidden_size
    weight = base.fc.weight.detach().clone()
    base.fc = nn.Linear((2 + aux_count) * D, D, bias=False)
    with torch.no_grad():
        base.fc.weight.zero_()
        base.fc.weight[:, :2 * D] = weight
    return base


def train(target, ids: torch.Tensor, features: torch.Tensor, settings: dict, steps: int, log):
    from specpair.distill import (CLASSIFICATION_WEIGHT, FEATURE_NOISE, DistillConfig, FeatureStream,
                                  build_head, kl_loss)

    config = DistillConfig(out="-", method="eagle", steps=steps, batch_size=8, seq_len=128,
                           lr=3e-3, seed=0)
    noise = FEATURE_NOISE if settings["noise"] is None else settings["noise"]
    D = target.model.config.hidden_size
    torch.manual_seed(0)
    head = build_head(target, ids, config)
    if settings["aux"]:
        head = fused_head(head, len(settings["aux"]))
    for name, p in head.named_parameters():
        if settings["freeze"] and name.startswith(settings["freeze"]):
            p.requires_grad_(False)
    stream = FeatureStream(ids, features, config.seq_len, config.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=settings["wd"])
    warm = max(1, steps // 20)
    head.train()
    started = time.perf_counter()
    for step in range(steps):
        lr = (config.lr * (step + 1) / warm if step < warm else
              config.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))
        for group in optimiser.param_groups:
            group["lr"] = lr
        batch, f = stream.feature_batch(config.batch_size)
        with torch.no_grad():
            embeds = target.model.get_input_embeddings()(batch)
        # distill's eagle_loss at depth 1, with the noise applied to each block of features alike
        inputs = torch.cat([p + (torch.rand_like(p) * 2 - 1) * noise * p.pow(2).mean().sqrt()
                            for p in f[:, :-1].split(D, dim=-1)], dim=-1)
        last = f[..., :D]
        with torch.no_grad():
            target_logits = head.lm_head(last[:, 1:])
        predicted = head(embeds[:, 1:], inputs)
        loss = (F.smooth_l1_loss(predicted, last[:, 1:])
                + CLASSIFICATION_WEIGHT * kl_loss(head.lm_head(predicted), target_logits))
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s)")
    return head.eval()


def main(argv=None) -> int:
    from head_agreement import agreement, prompt_conversations, reply_conversations
    from specpair.config import SpeculationConfig
    from specpair.decoding import SpeculativeEngine
    from specpair.distill import FEATURE_CHUNK, corpus_texts, instruction_prompts
    from specpair.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--replies", required=True, help="the training conversations (distill's replies.jsonl)")
    ap.add_argument("--heldout", required=True, help="conversations for other requests")
    ap.add_argument("--corpus-chars", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--variant", action="append", default=None,
                    help="NAME:key=value,... (keys: aux, noise, wd, freeze, steps); default: base")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in (args.variant or ["base"])]
    except ValueError as exc:
        ap.error(str(exc))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    target = load_model(args.target, dtype="float32")
    tok = target.tokenizer
    D = target.model.config.hidden_size
    reader = FeatureReader(target, [i for _, s in variants for i in s["aux"]])
    # distill's corpus (eval prompts held back as it does), then the conversations but their last token
    texts = corpus_texts("stdlib", args.corpus_chars, 0)
    ids = []
    for doc in (texts + instruction_prompts(texts, tok))[:-4]:
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    started = time.perf_counter()
    parts = [reader(chunk.tolist()) for chunk in torch.tensor(ids).split(FEATURE_CHUNK)]
    engine = SpeculativeEngine(target, speculation=SpeculationConfig(enabled=False))
    for conv, _ in reply_conversations(engine, args.replies):
        ids.extend(conv[:-1])
        parts.append(reader(conv[:-1]))
    ids, features = torch.tensor(ids), torch.cat(parts)
    log(f"features of {ids.numel()} tokens in {time.perf_counter() - started:.0f} s")
    sets = {"training replies (every 10th)": reply_conversations(engine, args.replies, stride=10, limit=40),
            "held-out": reply_conversations(engine, args.heldout),
            "held-out, QA and code": reply_conversations(engine, args.heldout, kinds=["qa", "code"]),
            "bench prompts' replies": prompt_conversations(engine, None, 64)}
    result = {"target": args.target, "replies": args.replies, "heldout": args.heldout,
              "corpus_chars": args.corpus_chars, "steps": args.steps, "tokens": ids.numel(),
              "variants": {}}
    for name, settings in variants:
        log(f"variant {name}: {settings}")
        cols = columns(reader, settings["aux"], D)
        read = lambda ids, cols=cols: reader(ids)[None, :, cols]  # noqa: E731
        t0 = time.perf_counter()
        head = train(target, ids, features[:, cols], settings, settings["steps"] or args.steps, log)
        result["variants"][name] = {
            "settings": settings, "train_seconds": round(time.perf_counter() - t0, 1),
            "first_draft_agreement": {k: agreement(target, head, v, read=read) for k, v in sets.items()}}
        Path(args.out).write_text(json.dumps(result, indent=1))
        log(json.dumps(result["variants"][name]["first_draft_agreement"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
