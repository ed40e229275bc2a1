"""`specpair` command line. Subcommand names and flags are a contract scripts rely on.

Heavy imports (torch, transformers) happen inside the handlers so `specpair --help` stays fast
and torch-free.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from specpair.config import KV_BUDGET_HELP, NGRAM_MAX, NGRAM_MIN, SpeculationConfig, kv_budget_flag
from specpair.errors import SpecpairError


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_pair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="target model: local directory, .gguf file, hub id, MLflow model URI "
                        "(models:/...), or 'default' (embedded SmolLM2-135M-Instruct)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--draft", default=None, help="draft model (same forms as --target)")
    group.add_argument("--drafter", choices=["ngram"], default=None,
                       help="model-free drafter (prompt lookup)")
    p.add_argument("--ngram-max", type=int, default=NGRAM_MAX, help="longest n-gram the lookup drafter matches")
    p.add_argument("--ngram-min", type=int, default=NGRAM_MIN, help="shortest n-gram the lookup drafter matches")
    p.add_argument("--k", type=int, default=SpeculationConfig.k,
                   help=f"draft tokens per round (default {SpeculationConfig.k})")
    p.add_argument("--no-dynamic-k", action="store_true", help="keep k fixed")
    p.add_argument("--tree-width", type=int, default=SpeculationConfig.tree_width,
                   help="drafting heads: candidates per draft position, verified as a token tree "
                        "in one pass (1: a chain)")
    p.add_argument("--lookup-min-match", type=int, default=SpeculationConfig.lookup_min_match,
                   help=f"drafting heads: where a request's last N tokens (this <= N <= "
                        f"{NGRAM_MAX}) occurred earlier, copy what followed them (prompt lookup) "
                        f"instead of asking the head (0: the head alone)")
    p.add_argument("--k-policy", choices=["auto", "cost", "heuristic"], default="auto",
                   help="dynamic k: 'cost' measures draft/verify costs here at start-up and picks the "
                        "k with most tokens per second; 'heuristic' grows on full acceptance, "
                        "shrinks on rejection; 'auto' (default): cost for model drafts, heuristic "
                        "for n-gram lookup (measured best for each, see README)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on "
                                                 "CPU, bf16 on CUDA)")
    p.add_argument("--on-mismatch", choices=["error", "target-only"], default="error",
                   help="what to do when the draft's tokenizer differs from the target's")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--kv", choices=["static", "dynamic"], default=None,
                   help="KV cache: static (preallocated, written in place; Llama, Mistral, Qwen2, "
                        "Qwen3; another model is refused when static is asked for) or dynamic "
                        "(Hugging Face's forward, any model). Default: SPECPAIR_KV, else static, "
                        "where the model runs it")
    p.add_argument("--compile", choices=["off", "on"], default=None,
                   help="compile the static step with torch.compile (warmed at start). "
                        "Default: SPECPAIR_COMPILE, else on for CUDA (CUDA graphs), off on the CPU")
    p.add_argument("--kv-budget", type=kv_budget_flag, default=None, help=KV_BUDGET_HELP)


def pair_from_flags(args, *, speculate: bool = True):
    """The pair the flags name. No target and no draft: the embedded default pair."""
    from specpair.config import ModelRef, PairSpec

    if args.k <= 0:
        raise SpecpairError(f"--k must be >= 1, got {args.k} (use --no-spec to turn speculation off)")
    drafter = args.drafter
    if args.target is None and args.draft is None and drafter is None:
        drafter = "ngram"   # the default pair: the best draft measured for SmolLM2 on CPU
    return PairSpec(target=ModelRef(args.target or "default"),
                    draft=ModelRef(args.draft) if speculate and args.draft else None,
                    drafter=drafter if speculate and not args.draft else None,
                    speculation=SpeculationConfig(k=args.k, dynamic_k=not args.no_dynamic_k,
                                                  enabled=speculate, tree_width=args.tree_width,
                                                  lookup_min_match=args.lookup_min_match),
                    ngram_max=args.ngram_max, ngram_min=args.ngram_min, on_mismatch=args.on_mismatch,
                    k_policy=args.k_policy, device=args.device, dtype=args.dtype, threads=args.threads,
                    kv=args.kv, compile=args.compile, kv_budget=args.kv_budget)


def build_engine(args, *, speculate: bool = True):
    from specpair.pair import load_pair

    return load_pair(pair_from_flags(args, speculate=speculate), progress=_progress)


def cmd_generate(args) -> int:
    from specpair.config import GenerationParams

    if args.prompt is None or not args.prompt.strip():
        raise SpecpairError("empty prompt: --prompt has no text")
    engine = build_engine(args, speculate=not args.no_spec)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop=tuple(args.stop or ()))
    result = engine.generate([args.prompt], params, chat=args.chat, speculate=not args.no_spec)[0]
    if args.json:
        out = result.to_dict()
        out["speculation"] = {"drafter": engine.drafter.describe() if engine.drafter else None,
                              "k": engine.config.k, "dynamic_k": engine.config.dynamic_k,
                              "enabled": not args.no_spec}
        print(json.dumps(out))
    else:
        print(result.text)
        s = result.stats
        _progress(f"[{len(result.token_ids)} tokens in {result.seconds:.2f} s; drafts {s.num_drafts}, "
                  f"acceptance {s.acceptance_rate:.2f}, mean acceptance length "
                  f"{s.mean_acceptance_length:.2f}, fallbacks {s.fallback_events}]")
    return 0


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from specpair.bench import format_table, load_prompts, run_bench

    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    engine = build_engine(args)
    if engine.drafter is None:
        raise SpecpairError("bench needs a draft: --draft MODEL or --drafter ngram")
    bar = tqdm(total=len(prompts), desc="bench", file=sys.stderr, disable=args.json and not sys.stderr.isatty())

    def progress(done, total, category):
        bar.update(1)
        bar.set_postfix_str(category)

    vllm_python = None
    if "vllm" in (args.peer or []):
        from specpair.vllm_peer import default_python

        vllm_python = args.vllm_python or str(default_python())
        if not os.path.exists(vllm_python):
            raise SpecpairError(f"--peer vllm: no vLLM python at {vllm_python}; run "
                                f"`bash scripts/setup-vllm.sh` or pass --vllm-python")

    report = run_bench(engine, prompts, max_new_tokens=args.max_new_tokens, runs=args.runs,
                       chat=not args.raw, hf_peer=not args.no_hf, progress=progress,
                       vllm_python=vllm_python, vllm_start_timeout=args.vllm_start_timeout,
                       note=_progress, hf_compiled="hf-compiled" in (args.peer or [])).to_dict()
    bar.close()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def cmd_distill(args) -> int:
    from specpair.distill import DistillConfig, distill

    config = DistillConfig(target=args.target, out=args.out, steps=args.steps,
                           batch_size=args.batch_size, seq_len=args.seq_len, layers=args.layers,
                           hidden=args.hidden, heads=args.heads, lr=args.lr, seed=args.seed,
                           checkpoint_every=args.checkpoint_every, device=args.device,
                           corpus=args.corpus, generated_fraction=args.generated_fraction,
                           eval_prompts=args.eval_prompts, init=args.init,
                           max_seconds=args.max_seconds, corpus_chars=args.corpus_chars,
                           method=args.method, draft_vocab=args.draft_vocab,
                           medusa_heads=args.medusa_heads, replies=args.replies,
                           reply_tokens=args.reply_tokens, ttt_depth=args.ttt_depth,
                           requests=args.requests, from_capture=args.from_capture,
                           category=args.category, golden_release=args.golden_release)
    summary = distill(config, progress=_progress)
    print(json.dumps(summary))
    return 0


def cmd_gate(args) -> int:
    from specpair.gate import run_gate_file

    verdict = run_gate_file(args.release, args.out, device=args.device, progress=_progress)
    print(json.dumps({k: verdict[k] for k in ("passed", "reasons")}))
    # The gate is done and its process about to end, with the gate runner waiting on it: frozen,
    # the objects torch and transformers made are left out of the interpreter's last collection
    # (measured on the tiny models: 2 to 5 s of a 16 to 34 s gate on the busy 2-core machine,
    # 0.7 to 2.5 CPU-seconds).
    gc.freeze()
    return 0 if verdict["passed"] or not args.fail_exit_code else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpair", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with speculative decoding")
    add_pair_arguments(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-spec", action="store_true", help="target-only decoding")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure speculative vs target-only decoding")
    add_pair_arguments(b)
    b.add_argument("--prompts", default=None, help="JSON Lines file of {prompt, category}")
    b.add_argument("--limit", type=int, default=None, help="first N prompts only")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--runs", type=int, default=3, help="runs per prompt; the median is reported")
    b.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    b.add_argument("--no-hf", action="store_true", help="skip the Hugging Face assisted peer")
    b.add_argument("--peer", action="append", choices=["vllm", "hf-compiled"], default=None,
                   help="also run the prompts through this peer (repeatable): 'vllm' starts a vLLM "
                        "server (target-only, then speculative with the same drafter and k) and adds "
                        "its tokens/s, acceptance and greedy identity beside ours; 'hf-compiled' "
                        "decodes target-only with Hugging Face's StaticCache and torch.compile "
                        "(mode reduce-overhead on CUDA, default elsewhere), gpt-fast's recipe")
    b.add_argument("--vllm-python", default=None,
                   help="python of the vLLM virtualenv (default: what scripts/setup-vllm.sh "
                        "prints, $SPECPAIR_VLLM_VENV/bin/python or "
                        "~/.cache/specpair/vllm-venv-0.32.0/bin/python)")
    b.add_argument("--vllm-start-timeout", type=float, default=None,
                   help="seconds to wait for each vLLM server to be healthy (default 180)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--out", default=None, help="also write the JSON report here")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("distill", help="train a small draft (or an EAGLE head) against the target")
    d.add_argument("--target", default=None)
    d.add_argument("--method", choices=["draft", "eagle", "medusa", "eagle3"], default="draft",
                   help="'draft': a small causal LM; 'eagle': a one-layer head drafting from the "
                        "target's own features; 'medusa': independent heads on the last feature; "
                        "'eagle3': an EAGLE-3 head on three of the target's layers, written in the "
                        "speculators format vLLM serves too (heads load with --draft DIR like any "
                        "draft)")
    d.add_argument("--draft-vocab", type=int, default=8192,
                   help="heads: their vocabulary size, the corpus's and the target's most "
                        "frequent tokens (0: the whole vocabulary)")
    d.add_argument("--medusa-heads", type=int, default=4, help="medusa: number of heads")
    d.add_argument("--replies", type=int, default=0,
                   help="first let the target answer this many chat requests built from the "
                        "corpus (greedy), and train on those conversations too: self-distillation "
                        "(kept in OUT/replies.jsonl; a resumed run does not generate them again)")
    d.add_argument("--reply-tokens", type=int, default=160, help="the longest generated reply")
    d.add_argument("--requests", default=None,
                   help="JSON Lines of chat requests ({\"prompt\", \"category\"}, as bench --prompts) "
                        "for the target to answer instead of requests built from the corpus, e.g. "
                        "your own traffic; with --replies N, the first N")
    d.add_argument("--ttt-depth", type=int, default=1,
                   help="eagle, eagle3: train this many draft steps unrolled, each on the head's own "
                        "predictions (EAGLE-3's training-time test; 1: real features only)")
    d.add_argument("--from-capture", default=None, metavar="DIR",
                   help="train on served requests a pair captured (DIR/<category>/*.jsonl of prompt "
                        "and reply token ids, docs/learning.md) instead of the corpus; with --category")
    d.add_argument("--category", default=None, help="--from-capture: the category whose requests train")
    d.add_argument("--golden-release", default=None, metavar="FILE",
                   help="--from-capture: a release JSON whose golden prompts of --category measure the "
                        "draft before and after training (never trained on: the gate measures on them)")
    d.add_argument("--out", required=True, help="output model directory (also holds checkpoints)")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--batch-size", type=int, default=4)
    d.add_argument("--seq-len", type=int, default=128)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--hidden", type=int, default=256)
    d.add_argument("--heads", type=int, default=4)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--checkpoint-every", type=int, default=50)
    d.add_argument("--device", default=None)
    d.add_argument("--corpus", default="stdlib", help="'stdlib' or a directory/file of text")
    d.add_argument("--generated-fraction", type=float, default=0.0,
                   help="share of batches made of target-generated continuations")
    d.add_argument("--eval-prompts", type=int, default=4)
    d.add_argument("--max-seconds", type=float, default=None, help="training time budget")
    d.add_argument("--corpus-chars", type=int, default=3_000_000, help="corpus size in characters")
    d.add_argument("--init", choices=["projection", "truncate"], default="projection",
                   help="fresh student with projected embeddings, or the target's first layers")
    d.set_defaults(func=cmd_distill)

    gt = sub.add_parser("gate", help="golden-prompt gate for a release (writes a verdict JSON)")
    gt.add_argument("--release", required=True, help="release JSON (see docs)")
    gt.add_argument("--out", required=True, help="where to write the verdict JSON")
    gt.add_argument("--device", default=None)
    gt.add_argument("--fail-exit-code", action="store_true",
                    help="exit 3 when the gate fails (default: 0, the verdict says it)")
    gt.set_defaults(func=cmd_gate)

    from specpair import model_fetch
    model_fetch.add_parser(sub)

    try:
        from specpair.server.cli import add_engine_parser
    except ImportError:
        pass
    else:
        add_engine_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except SpecpairError as exc:
        print(f"specpair: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
